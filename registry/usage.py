"""Usage records for billing: one row per engine request, idempotent by request id.

The pattern of ../shared/reference/platform.md, section 3.2: rows are written with
INSERT ... ON CONFLICT (tenant_id, request_id) DO NOTHING (SQLite and PostgreSQL), so replaying a batch after
a crash or retry never double-bills; the export hands rows out at-least-once with the request id as
the CloudEvents 1.0 `id`, so any downstream billing system can dedupe. Time ranges and days use
`finished_at` in UTC. The export's cursor is commit-safe with several writers (a fleet's replicas on
one PostgreSQL): see `export_usage`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, Select, func, literal_column, select, text, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from registry.db import transactional
from registry.models import UsageRow
from registry.provenance import Provenance, coerce_provenance

GroupBy = Literal["day", "adapter", "key", "tenant"]
# Group key of requests served by the base model; adapter keys always contain "@".
BASE_MODEL_KEY = "base"
CLOUDEVENT_TYPE = "dev.loraserve.request.usage"


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one request cost, as metered when it ended (finished, stopped, aborted or failed)."""

    request_id: str
    tenant_id: str
    key_prefix: str | None
    adapter_name: str | None  # None = base model
    adapter_version: int | None
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int
    finish_reason: str
    queue_time_s: float
    ttft_s: float | None  # None when no token was produced
    total_time_s: float
    created_at: datetime
    finished_at: datetime
    user: str | None = None  # the request's OpenAI `user` (the tenant's own end-user id)
    provenance: Provenance | None = None  # what produced the answer; None: written before provenance was kept

    def __post_init__(self) -> None:
        # Read back from the JSON column or the journal as a dict: the dataclass from here on.
        object.__setattr__(self, "provenance", coerce_provenance(self.provenance))
        if not self.request_id:
            raise ValueError("usage record needs a non-empty request_id")
        for name in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)} ({self.request_id})")
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_prompt_tokens {self.cached_prompt_tokens} > prompt_tokens {self.prompt_tokens} "
                f"({self.request_id})"
            )
        if (self.adapter_name is None) != (self.adapter_version is None):
            raise ValueError(
                f"adapter_name and adapter_version must be both set or both None ({self.request_id})"
            )
        if self.created_at.tzinfo is None or self.finished_at.tzinfo is None:
            raise ValueError(f"created_at and finished_at must be timezone-aware ({self.request_id})")

    @classmethod
    def from_row(cls, row: UsageRow) -> UsageRecord:
        return cls(**{f.name: getattr(row, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True, slots=True)
class UsageGroup:
    key: str  # "2026-11-29" | "name@version" or BASE_MODEL_KEY | key prefix | tenant id
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class UsagePage:
    records: list[UsageRecord]
    next_cursor: str | None  # pass back to continue after the last record; None when nothing read yet
    has_more: bool  # the page was full: ask again at once


@transactional
def write_usage(session: Session, records: list[UsageRecord]) -> int:
    """Insert the records whose (tenant, request id) is new; returns how many were inserted."""
    by_key = {(r.tenant_id, r.request_id): r for r in reversed(records)}
    unique = list(by_key.values())[::-1]  # first of duplicates wins
    if not unique:
        return 0
    dialect = session.get_bind().dialect.name
    insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}.get(dialect)
    if insert is None:
        raise ValueError(f"write_usage supports sqlite and postgresql, got dialect {dialect!r}")
    table = UsageRow.__table__
    stmt = insert(table)
    if dialect == "postgresql":  # the export's commit-safe order (export_usage)
        stmt = stmt.values(txid=literal_column("pg_current_xact_id()::text::bigint"))
    stmt = stmt.on_conflict_do_nothing(index_elements=["tenant_id", "request_id"]).returning(
        table.c.request_id
    )
    inserted = session.execute(stmt, [dataclasses.asdict(r) for r in unique]).all()
    return len(inserted)


@transactional
def is_request_id_used(session: Session, *, tenant_id: str, request_id: str) -> bool:
    """Whether the tenant was already billed a request with this id (the unique key's index)."""
    stmt = select(UsageRow.id).where(UsageRow.tenant_id == tenant_id, UsageRow.request_id == request_id)
    return session.execute(stmt.limit(1)).first() is not None


def _day(session: Session) -> ColumnElement[str]:
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        return func.strftime("%Y-%m-%d", UsageRow.finished_at)
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", UsageRow.finished_at), "YYYY-MM-DD")
    raise ValueError(f"usage_summary supports sqlite and postgresql, got dialect {dialect!r}")


def _in_range(
    query: Select[Any], tenant_id: str | None, start: datetime | None, end: datetime | None
) -> Select[Any]:
    if tenant_id is not None:
        query = query.where(UsageRow.tenant_id == tenant_id)
    if start is not None:
        query = query.where(UsageRow.finished_at >= start)
    if end is not None:
        query = query.where(UsageRow.finished_at < end)
    return query


@transactional
def usage_summary(
    session: Session,
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: GroupBy = "day",
) -> list[UsageGroup]:
    """Totals of requests finished in [start, end), grouped and sorted by key."""
    columns: dict[str, list[Any]] = {
        "day": [_day(session)] if group_by == "day" else [],
        "adapter": [UsageRow.adapter_name, UsageRow.adapter_version],
        "key": [UsageRow.key_prefix],
        "tenant": [UsageRow.tenant_id],
    }
    if group_by not in columns:
        raise ValueError(f"group_by must be one of {sorted(columns)}, got {group_by!r}")
    group = columns[group_by]
    totals = (
        func.count(),
        func.sum(UsageRow.prompt_tokens),
        func.sum(UsageRow.cached_prompt_tokens),
        func.sum(UsageRow.completion_tokens),
    )
    query = _in_range(select(*group, *totals).group_by(*group), tenant_id, start, end)
    result = []
    for row in session.execute(query):
        *parts, requests, prompt, cached, completion = row
        if group_by == "adapter":
            key = BASE_MODEL_KEY if parts[0] is None else f"{parts[0]}@{parts[1]}"
        else:
            key = "" if parts[0] is None else str(parts[0])
        result.append(UsageGroup(key, int(requests), int(prompt), int(cached), int(completion)))
    return sorted(result, key=lambda g: g.key)


@transactional
def export_usage(
    session: Session,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    cursor: str | None = None,
    limit: int = 1000,
    tenant_id: str | None = None,
) -> UsagePage:
    """Raw records in commit-safe order, `limit` at a time, resumable from `cursor`: every row once.

    SQLite has one writer, so rows commit in id order and the cursor is the last id. On PostgreSQL
    several replicas write at once and a lower id can commit after a higher one was read; there each
    row carries its writing transaction's id (`txid`), and a page holds only rows whose transaction
    is older than every transaction still running (`pg_snapshot_xmin(pg_current_snapshot())`): no
    row can appear later below that horizon, so ordering by (txid, id) and resuming after the last
    pair skips nothing and repeats nothing. A transaction left open holds the export back until it
    ends (registry/README.md). The cursor there is "<txid>.<id>" (a bare id: (0, id), older cursors).
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    after = _parse_cursor(cursor)
    query = _in_range(select(UsageRow), tenant_id, start, end)
    if session.get_bind().dialect.name != "postgresql":
        query = query.where(UsageRow.id > after[1]).order_by(UsageRow.id)
        rows = list(session.scalars(query.limit(limit)))
        next_cursor = str(rows[-1].id) if rows else cursor
    else:
        horizon = session.scalar(text("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint"))
        query = query.where(UsageRow.txid < horizon, tuple_(UsageRow.txid, UsageRow.id) > tuple_(*after))
        rows = list(session.scalars(query.order_by(UsageRow.txid, UsageRow.id).limit(limit)))
        next_cursor = f"{rows[-1].txid}.{rows[-1].id}" if rows else cursor
    return UsagePage([UsageRecord.from_row(r) for r in rows], next_cursor, has_more=len(rows) == limit)


def _parse_cursor(cursor: str | None) -> tuple[int, int]:
    """(txid, id) after which the export resumes; both BIGINT, so never longer than 19 digits."""
    if not cursor:
        return (0, 0)
    parts = cursor.split(".")
    if len(parts) > 2 or not all(
        p.isascii() and p.isdigit() and len(p) <= 19 and int(p) < 2**63 for p in parts
    ):
        raise ValueError(f"cursor must be one returned by export_usage, got {cursor[:40]!r}")
    return (0, int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def to_cloudevent(record: UsageRecord, *, source: str = "loraserve") -> dict[str, Any]:
    """A CloudEvents 1.0 JSON event of one record; `id` is the request id, unique within its tenant, so
    `source` names the tenant too (`<source>/tenants/<tenant id>`): (source, id) is the dedupe key."""
    data = dataclasses.asdict(record)
    data["created_at"] = record.created_at.isoformat()
    data["finished_at"] = record.finished_at.isoformat()
    return {
        "specversion": "1.0",
        "type": CLOUDEVENT_TYPE,
        "source": f"{source}/tenants/{record.tenant_id}",
        "id": record.request_id,
        "subject": record.tenant_id,
        "time": record.finished_at.isoformat(),
        "datacontenttype": "application/json",
        "data": data,
    }
