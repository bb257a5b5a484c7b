"""What the Tenants, Adapters and Usage pages show, read through the registry's service functions.

Every function takes a SQLAlchemy `Session` (one transaction per registry call) and returns small
dataclasses for the templates. Usage numbers come from `registry.usage.usage_summary`, and the CSV
from the billing API's own grouping (`api.routes.usage.admin_summary`), so the console and
`GET /admin/api/usage` can never disagree.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from sqlalchemy.orm import Session

from api.admin.service import audit_view, key_view, tenant_view
from api.routes.usage import COLUMNS, admin_summary
from api.tenant_adapters.views import Residency
from base_engine.async_engine import AsyncEngine
from registry.adapters import get_adapter, list_adapters
from registry.audit import list_audit
from registry.errors import NotFound
from registry.keys import list_keys
from registry.tenants import get_tenant, list_tenants
from registry.types import AdapterVersionInfo, TenantInfo
from registry.usage import GroupBy, UsageGroup, usage_summary

NO_USAGE = UsageGroup(key="", requests=0, prompt_tokens=0, cached_prompt_tokens=0, completion_tokens=0)


@dataclass(frozen=True, slots=True)
class DateRange:
    """Whole UTC days, both ends included (what a date picker means)."""

    start: date
    end: date

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"range end {self.end} is before its start {self.start}")

    @classmethod
    def parse(cls, start: str | None, end: str | None, *, today: date | None = None) -> DateRange:
        """From `YYYY-MM-DD` strings; defaults: this month so far. ValueError names a bad value."""
        today = today or datetime.now(UTC).date()
        try:
            first = date.fromisoformat(start) if start else today.replace(day=1)
            last = date.fromisoformat(end) if end else today
        except ValueError:
            raise ValueError(f"dates must be YYYY-MM-DD, got start={start!r}, end={end!r}") from None
        return cls(first, last)

    @property
    def since(self) -> datetime:
        return datetime.combine(self.start, time.min, tzinfo=UTC)

    @property
    def until(self) -> datetime:
        """Exclusive end: midnight after the last day."""
        return datetime.combine(self.end + timedelta(days=1), time.min, tzinfo=UTC)

    def days(self) -> list[str]:
        n = (self.end - self.start).days + 1
        return [(self.start + timedelta(days=i)).isoformat() for i in range(n)]


def summary(
    session: Session, *, period: DateRange, group_by: GroupBy, tenant_id: str | None = None
) -> dict[str, UsageGroup]:
    groups = usage_summary(
        session, tenant_id=tenant_id, start=period.since, end=period.until, group_by=group_by
    )
    return {g.key: g for g in groups}


@dataclass(frozen=True, slots=True)
class TenantRow:
    tenant: dict[str, Any]  # api.admin.service.tenant_view
    num_active_keys: int
    usage: UsageGroup  # this period


def tenant_rows(session: Session, *, period: DateRange) -> list[TenantRow]:
    usage = summary(session, period=period, group_by="tenant")
    rows = []
    for info in list_tenants(session):
        keys = list_keys(session, tenant_id=info.id, include_revoked=False)
        rows.append(TenantRow(tenant_view(info), len(keys), usage.get(info.id, NO_USAGE)))
    return rows


@dataclass(frozen=True, slots=True)
class TenantDetail:
    tenant: dict[str, Any]
    keys: list[dict[str, Any]]
    usage_by_adapter: list[UsageGroup]
    usage_by_key: list[UsageGroup]
    audit: list[dict[str, Any]]


def tenant_detail(session: Session, *, tenant_id: str, period: DateRange) -> TenantDetail:
    info = get_tenant(session, tenant_id=tenant_id)
    return TenantDetail(
        tenant=tenant_view(info),
        keys=[key_view(k) for k in list_keys(session, tenant_id=tenant_id)],
        usage_by_adapter=list(
            summary(session, period=period, group_by="adapter", tenant_id=info.id).values()
        ),
        usage_by_key=list(summary(session, period=period, group_by="key", tenant_id=info.id).values()),
        audit=[audit_view(a) for a in list_audit(session, tenant_id=tenant_id, limit=20)],
    )


@dataclass(frozen=True, slots=True)
class AdapterRow:
    tenant_id: str
    tenant_name: str
    name: str
    version: int
    rank: int
    modules: tuple[str, ...]
    size_bytes: int
    sha256: str
    status: str
    residency: str  # "gpu" | "cpu" | "disk" | "store"
    is_pinned: bool
    usage: UsageGroup  # all time
    spec_acceptance: float | None = None  # speculative drafts accepted / scored; None: none scored

    @property
    def ref_id(self) -> str:
        return f"{self.tenant_id}/{self.name}@{self.version}"


def adapter_rows(
    session: Session, *, engine: AsyncEngine, residency: Residency, tenant_id: str | None = None
) -> list[AdapterRow]:
    """Every tenant's ready adapter versions with residency, pin state and request/token counts."""
    tenants: dict[str, TenantInfo] = {t.id: t for t in list_tenants(session, include_deleted=True)}
    versions = list_adapters(session, tenant_id=tenant_id)
    pinned = set(_pinned(engine))
    acceptance = engine.stats().spec_acceptance
    usage: dict[str, dict[str, UsageGroup]] = {}
    for owner in dict.fromkeys(v.tenant_id for v in versions):
        groups = usage_summary(session, tenant_id=owner, group_by="adapter")
        usage[owner] = {g.key: g for g in groups}
    return [
        _adapter_row(residency, v, tenants, pinned, usage[v.tenant_id], acceptance.get(v.ref_id))
        for v in versions
    ]


def _adapter_row(
    residency: Residency,
    info: AdapterVersionInfo,
    tenants: dict[str, TenantInfo],
    pinned: set[str],
    usage: dict[str, UsageGroup],
    spec_acceptance: float | None,
) -> AdapterRow:
    owner = tenants.get(info.tenant_id)
    return AdapterRow(
        tenant_id=info.tenant_id,
        tenant_name=owner.name if owner else info.tenant_id,
        name=info.name,
        version=info.version,
        rank=info.max_rank,
        modules=info.modules,
        size_bytes=info.size_bytes,
        sha256=info.sha256,
        status=info.status,
        residency=residency.of(info),
        is_pinned=info.ref_id in pinned,
        usage=usage.get(f"{info.name}@{info.version}", NO_USAGE),
        spec_acceptance=spec_acceptance,
    )


@dataclass(frozen=True, slots=True)
class CoverageRow:
    layer: int
    module: str
    kind: str
    rank: int
    scale: float
    delta_fro: float
    relative_delta: float | None


@dataclass(frozen=True, slots=True)
class AdapterDetail:
    row: AdapterRow
    kinds: list[str] | None  # None: uploaded before coverage reports were stored
    warning: str | None
    coverage: list[CoverageRow]  # by layer, then module


def adapter_detail(
    session: Session, *, engine: AsyncEngine, residency: Residency, tenant_id: str, name: str, version: int
) -> AdapterDetail:
    """One ready adapter version with its coverage report (adapters/coverage.py, as stored at upload)."""
    infos = [v for v in get_adapter(session, tenant_id=tenant_id, name=name) if v.version == version]
    if not infos:
        raise NotFound("adapter version", f"{name}@{version}")
    row = next(r for r in adapter_rows(session, engine=engine, residency=residency, tenant_id=tenant_id)
               if r.name == name and r.version == version)  # fmt: skip
    report = infos[0].coverage
    if report is None:
        return AdapterDetail(row=row, kinds=None, warning=None, coverage=[])
    cells = [
        CoverageRow(layer=int(layer), module=module, **fields)
        for layer, modules in report["layers"].items()
        for module, fields in modules.items()
    ]
    cells.sort(key=lambda c: (c.layer, c.module))
    return AdapterDetail(row=row, kinds=list(report["kinds"]), warning=report["warning"], coverage=cells)


def _pinned(engine: AsyncEngine) -> list[str]:
    return list(engine.stats().adapters.pinned)


@dataclass(frozen=True, slots=True)
class UsageReport:
    period: DateRange
    tenant_id: str | None
    by_tenant: list[tuple[str, UsageGroup]]  # (tenant name, totals)
    by_adapter: list[tuple[str, UsageGroup]]  # (tenant name, totals keyed "name@version" | "base")
    by_day: list[UsageGroup]  # one per day of the period, zeros included, oldest first

    @property
    def total(self) -> UsageGroup:
        fields = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
        sums = {f: sum(getattr(g, f) for _, g in self.by_tenant) for f in fields}
        return UsageGroup(key="total", **sums)


def usage_report(session: Session, *, period: DateRange, tenant_id: str | None) -> UsageReport:
    names = {t.id: t.name for t in list_tenants(session, include_deleted=True)}
    by_tenant = summary(session, period=period, group_by="tenant", tenant_id=tenant_id)
    by_adapter = [
        (names.get(owner, owner), group)
        for owner in by_tenant
        for group in summary(session, period=period, group_by="adapter", tenant_id=owner).values()
    ]
    days = summary(session, period=period, group_by="day", tenant_id=tenant_id)
    return UsageReport(
        period=period,
        tenant_id=tenant_id,
        by_tenant=[(names.get(k, k), g) for k, g in by_tenant.items()],
        by_adapter=by_adapter,
        by_day=[days.get(d, dataclasses.replace(NO_USAGE, key=d)) for d in period.days()],
    )


def usage_csv(session: Session, *, period: DateRange, group_by: GroupBy, tenant_id: str | None) -> str:
    """The billing API's CSV (`GET /admin/api/usage?format=csv`) for whole days: same groups, same columns."""
    groups = admin_summary(
        session, tenant_id=tenant_id, start=period.since, end=period.until, group_by=group_by
    )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")  # RFC 4180, as the billing API writes it
    writer.writerow(COLUMNS)
    writer.writerows([getattr(g, c) for c in COLUMNS] for g in groups)
    return out.getvalue()
