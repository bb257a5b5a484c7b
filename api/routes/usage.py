"""Usage for billing and Prometheus metrics.

- `GET /v1/usage` (tenant key): the caller's own totals, `start`/`end`/`group_by=day|adapter|key`.
- `GET /admin/api/usage` (admin key): every tenant's totals, `group_by` also `tenant`, `tenant_id`
  filter, `format=json|csv`.
- `GET /admin/api/usage/export` (admin key): raw records as CloudEvents 1.0 JSON lines (`id` = request
  id, so any billing system can dedupe), resumable: pass `X-Next-Cursor` back as `cursor`.
- `GET /metrics`: Prometheus text format, unauthenticated as scrapers expect (bind the server to a
  private interface in production); no tenant names or ids unless `metrics_tenant_labels` is set or
  the scrape sends `Authorization: Bearer <metrics_token>` (api/metrics/prometheus.py).
Every usage read flushes the meter first, so it includes each request that finished before it.
Times are ISO 8601 (a date means midnight UTC; no zone means UTC) or Unix seconds; [start, end).
"""

from __future__ import annotations

import csv
import hmac
import io
import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy.orm import Session

from api.deps import AdminDep, SessionDep, StateDep, TenantDep
from api.errors import APIError, responses
from api.http.blocking import run_in
from api.metrics.sampler import refresh_engine_metrics
from api.state import AppState
from registry.usage import GroupBy, UsageGroup, export_usage, to_cloudevent, usage_summary

logger = logging.getLogger(__name__)
router = APIRouter(tags=["usage"])
COLUMNS = ("key", "requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")


def parse_time(value: str | None, param: str) -> datetime | None:
    if value is None or value == "":
        return None
    try:
        parsed = datetime.fromtimestamp(float(value), UTC)
    except (ValueError, OverflowError, OSError):  # not a number, or no representable time (inf, 1e300)
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise APIError(
                400,
                f"{param} must be an ISO 8601 date/time or Unix seconds, got {value!r}",
                param=param,
                code="invalid_value",
            ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def flush_usage(state: AppState) -> None:
    try:
        state.inference.meter.flush()
    except Exception as exc:  # noqa: BLE001 - a read must not pretend to be complete
        logger.warning("usage flush before a read failed: %r", exc)
        message = "usage records cannot be written now; retry later"
        raise APIError(503, message, code="usage_unavailable") from exc


def group_view(group: UsageGroup) -> dict[str, Any]:
    return {name: getattr(group, name) for name in COLUMNS}


@router.get("/v1/usage", responses=responses(400, 401))
def tenant_usage(
    state: StateDep,
    session: SessionDep,
    caller: TenantDep,
    start: str | None = None,
    end: str | None = None,
    group_by: Literal["day", "adapter", "key"] = "day",
) -> dict[str, Any]:
    flush_usage(state)
    groups = usage_summary(
        session,
        tenant_id=caller.tenant.id,
        start=parse_time(start, "start"),
        end=parse_time(end, "end"),
        group_by=group_by,
    )
    return {"object": "list", "data": [group_view(g) for g in groups]}


def admin_summary(
    session: Session,
    *,
    tenant_id: str | None,
    start: datetime | None,
    end: datetime | None,
    group_by: GroupBy,
) -> list[UsageGroup]:
    """Across tenants, adapters are grouped per tenant ("<tenant id>/<name>@<version>"): two tenants'
    adapters may share a name, and a bill line must belong to one tenant."""
    if group_by != "adapter" or tenant_id is not None:
        return usage_summary(session, tenant_id=tenant_id, start=start, end=end, group_by=group_by)
    groups = []
    for tenant in usage_summary(session, start=start, end=end, group_by="tenant"):
        for g in usage_summary(session, tenant_id=tenant.key, start=start, end=end, group_by="adapter"):
            groups.append(UsageGroup(f"{tenant.key}/{g.key}", *(getattr(g, c) for c in COLUMNS[1:])))
    return groups


@router.get("/admin/api/usage", response_model=None, responses=responses(400, 401))
def all_usage(
    _: AdminDep,
    state: StateDep,
    session: SessionDep,
    start: str | None = None,
    end: str | None = None,
    group_by: Literal["day", "adapter", "key", "tenant"] = "day",
    tenant_id: str | None = None,
    format: Literal["json", "csv"] = "json",  # noqa: A002 - the query parameter's name
) -> dict[str, Any] | Response:
    flush_usage(state)
    start_at, end_at = parse_time(start, "start"), parse_time(end, "end")
    groups = admin_summary(session, tenant_id=tenant_id, start=start_at, end=end_at, group_by=group_by)
    if format == "json":
        return {"object": "list", "data": [group_view(g) for g in groups]}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")  # RFC 4180
    writer.writerow(COLUMNS)
    writer.writerows([getattr(g, c) for c in COLUMNS] for g in groups)
    headers = {"Content-Disposition": f'attachment; filename="usage-by-{group_by}.csv"'}
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8", headers=headers)


@router.get("/admin/api/usage/export", responses=responses(400, 401))
def export(
    _: AdminDep,
    state: StateDep,
    session: SessionDep,
    start: str | None = None,
    end: str | None = None,
    cursor: str | None = None,
    limit: int = Query(1000, ge=1, le=10_000),
    tenant_id: str | None = None,
) -> Response:
    flush_usage(state)
    try:
        page = export_usage(
            session,
            start=parse_time(start, "start"),
            end=parse_time(end, "end"),
            cursor=cursor,
            limit=limit,
            tenant_id=tenant_id,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param="cursor", code="invalid_value") from None
    body = "".join(json.dumps(to_cloudevent(r)) + "\n" for r in page.records)
    headers = {"X-Has-More": "true" if page.has_more else "false"}
    if page.next_cursor is not None:
        headers["X-Next-Cursor"] = page.next_cursor
    return Response(body, media_type="application/x-ndjson", headers=headers)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: StateDep) -> Response:
    metrics = state.metrics
    include_tenants = may_see_tenants(request, state)

    def render() -> tuple[bytes, str]:
        # The gauges as of this scrape, not of the last sampler tick.
        refresh_engine_metrics(metrics=metrics, engine=state.engine, disk=state.disk)
        return metrics.render(include_tenants=include_tenants)

    # In the server's own small pool: never queued behind anyio's shared pool.
    payload, content_type = await run_in(state.pools.ops, render)
    return Response(payload, media_type=content_type)


def may_see_tenants(request: Request, state: AppState) -> bool:
    """Per-tenant series: when the operator opted in, or for a scrape with the metrics token (or the
    admin key). No key shows the anonymous series; a wrong one is 401, so a misconfigured scraper
    fails loudly instead of silently losing series."""
    if state.settings.metrics_tenant_labels:
        return True
    header = request.headers.get("authorization")
    if header is None:
        return False
    scheme, _, token = header.partition(" ")
    allowed = [state.admin_key]
    if state.settings.metrics_token is not None:
        allowed.append(state.settings.metrics_token.get_secret_value())
    if scheme.lower() == "bearer" and any(
        hmac.compare_digest(token.strip().encode(), key.encode()) for key in allowed
    ):
        return True
    raise APIError(
        401,
        "Incorrect metrics token (send 'Authorization: Bearer <metrics token>', or no header).",
        code="invalid_metrics_token",
        headers={"WWW-Authenticate": "Bearer"},
    )
