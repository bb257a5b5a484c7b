"""The fleet's quota tables read and written as api/tenancy/quotas.py's `TenantState`s.

`api/tenancy/quotas_db.py` decides admissions and releases; this module holds what it does to the rows inside
its transactions: lock (or create) a tenant's `quota_buckets` row, drop its expired leases and count the
live ones, turn a row into buckets and back, and read the database's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import delete, func, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api.tenancy.quotas import Bucket, TenantState
from registry.fleet_state_models import QuotaBucketRow, QuotaLeaseRow


def lock_row(session: Session, tenant_id: str) -> QuotaBucketRow:
    """The tenant's bucket row, locked until the transaction ends (created on first use)."""
    row = session.get(QuotaBucketRow, tenant_id, with_for_update=True)
    if row is None:
        insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}[session.get_bind().dialect.name]
        session.execute(
            insert(QuotaBucketRow).values(tenant_id=tenant_id, updated_at=0.0).on_conflict_do_nothing()
        )
        row = session.get(QuotaBucketRow, tenant_id, with_for_update=True, populate_existing=True)
        assert row is not None
    return row


def live_state(session: Session, row: QuotaBucketRow, now: float) -> TenantState:
    """The row as a TenantState, with the live leases counted (expired ones are dropped)."""
    session.execute(
        delete(QuotaLeaseRow).where(QuotaLeaseRow.tenant_id == row.tenant_id, QuotaLeaseRow.expires_at <= now)
    )
    state = bucket_state(row)
    state.num_concurrent = num_live_leases(session, row.tenant_id, now)
    return state


def num_live_leases(session: Session, tenant_id: str, now: float) -> int:
    live = select(func.count()).where(QuotaLeaseRow.tenant_id == tenant_id, QuotaLeaseRow.expires_at > now)
    return int(session.scalar(live) or 0)


def bucket_state(row: QuotaBucketRow) -> TenantState:
    """The row's buckets (no concurrency count: a release only gives tokens and requests back)."""
    return TenantState(
        requests=_bucket(row.requests_capacity, row.requests_level, row.updated_at),
        tokens=_bucket(row.tokens_capacity, row.tokens_level, row.updated_at),
    )


def write_row(row: QuotaBucketRow, state: TenantState, now: float) -> None:
    row.requests_capacity = state.requests.capacity if state.requests else None
    row.requests_level = state.requests.level if state.requests else None
    row.tokens_capacity = state.tokens.capacity if state.tokens else None
    row.tokens_level = state.tokens.level if state.tokens else None
    row.updated_at = now


def db_now(session: Session, clock: Callable[[], float] | None) -> float:
    """`clock()` when given (tests), else the database's clock, so replicas whose clocks differ agree."""
    if clock is not None:
        return clock()
    if session.get_bind().dialect.name == "postgresql":
        return float(session.scalar(text("SELECT extract(epoch FROM clock_timestamp())")))
    return time.time()  # SQLite: one machine, one clock


def _bucket(capacity: float | None, level: float | None, updated_at: float) -> Bucket | None:
    return None if capacity is None or level is None else Bucket(capacity, level, updated_at)
