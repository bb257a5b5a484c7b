"""The fleet's rate limits: api/tenancy/quotas.py's rules with the counters in the shared database.

N replicas enforce a tenant's rpm/tpm/concurrency once, not N times. Each admission is one short
transaction: lock the tenant's `quota_buckets` row (SELECT ... FOR UPDATE; SQLite's BEGIN IMMEDIATE),
drop its expired leases, count the live ones, then run the same `refill` / `check` / `take` as the
in-memory backend and write the row and a new lease back. No lock is held across the request.

- Time is the database's clock (`clock_timestamp()` on PostgreSQL), so replicas whose clocks differ
  refill alike; tests inject a clock instead.
- Concurrency is a lease per admitted request (`quota_leases`: id, holder, expiry). This process
  renews the leases it holds every `renew_every_s`, so a replica killed with -9 leaks its slots for
  at most `lease_ttl_s`. A request that outlives a long database outage may lose its lease (the
  tenant may briefly run more than its limit); that errs on the side of serving.
- Releases and refunds are written by a background thread (the request's end must not wait on the
  database, which may be down); an admission on this replica writes any still-pending ones first,
  so a client that sends its next request at once is never refused by its own finished one.
- The rows are read and written through api/tenancy/quota_rows.py (lock, live leases, row <-> TenantState).
- A database outage during admission is 503 `database_unavailable` + Retry-After (api/errors.py),
  never a silent unlimited pass: a fleet without its database cannot count, so it does not admit.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import delete, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from api.errors import database_unavailable, is_database_outage
from api.settings import Settings
from api.tenancy.quota_rows import bucket_state, db_now, live_state, lock_row, num_live_leases, write_row
from api.tenancy.quotas import (
    Admission,
    Limits,
    QuotaExceededError,
    QuotaLimiter,
    TenantState,
    check,
    give_back,
    headers_of,
    refill,
    release_tokens,
    take,
)
from registry.fleet_state_models import QuotaBucketRow, QuotaLeaseRow
from registry.types import TenantQuotas

logger = logging.getLogger(__name__)

LEASE_TTL_S = 30.0  # a dead replica's concurrency slots come back after this long
RENEW_EVERY_S = 10.0  # live leases are extended this often (a third of the TTL: two renewals may fail)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A release or refund not yet written: the lease to drop and what goes back to the buckets."""

    tenant_id: str
    lease_id: str
    requests: int
    tokens: int


class DbQuotaLimiter(QuotaLimiter):
    def __init__(
        self,
        sessions: sessionmaker[Session],
        defaults: TenantQuotas | None = None,
        *,
        holder: str | None = None,
        window_s: float = 60.0,
        clock: Callable[[], float] | None = None,
        lease_ttl_s: float = LEASE_TTL_S,
        renew_every_s: float = RENEW_EVERY_S,
    ) -> None:
        super().__init__(defaults, window_s=window_s)
        self.sessions = sessions
        # The process incarnation is part of the holder: a restarted replica never renews its dead
        # predecessor's leases, even under the same replica id.
        self.holder = f"{holder or f'{socket.gethostname()}-{os.getpid()}'}/{secrets.token_hex(4)}"[-128:]
        self._clock = clock  # None: the database's clock
        self.lease_ttl_s = lease_ttl_s
        self.renew_every_s = renew_every_s
        self._held: set[str] = set()  # lease ids this process holds and renews
        self._pending: list[_Pending] = []
        self._mutex = threading.Lock()  # guards _held and _pending
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraserve-quota-leases", daemon=True)
        self._thread.start()

    # ---- admission ---------------------------------------------------------------------------

    def precheck(self, tenant_id: str, quotas: TenantQuotas | None) -> None:
        """None here: a fleet's decision is one database transaction, at admission; a pre-check would
        double the round trips of every request to spare the planning of refused ones."""

    def admit(self, tenant_id: str, quotas: TenantQuotas | None, *, estimated_tokens: int) -> Admission:
        if estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be >= 0, got {estimated_tokens}")
        limits = self.limits(quotas)
        lease_id = secrets.token_hex(16)
        try:
            self._flush()  # this replica's finished requests first: they no longer count
            headers = self._admit(tenant_id, limits, estimated_tokens, lease_id)
        except sa_exc.SQLAlchemyError as exc:
            if is_database_outage(exc):
                logger.warning("quota admission: database unavailable: %s", exc)
                raise database_unavailable() from None
            raise
        with self._mutex:
            self._held.add(lease_id)
        return Admission(self, tenant_id, estimated_tokens, headers=headers, lease_id=lease_id)

    def _admit(self, tenant_id: str, limits: Limits, tokens: int, lease_id: str) -> dict[str, str]:
        with self.sessions() as session, session.begin():
            row = lock_row(session, tenant_id)
            now = max(self._now(session), row.updated_at)  # a clock stepping back never drains a bucket
            state = live_state(session, row, now)
            refill(state, limits, now, self.window_s)
            try:
                check(tenant_id, limits, state, tokens, self.window_s)
            except QuotaExceededError as exc:
                exc.headers = headers_of(state, limits, self.window_s)
                raise  # rolls back: a refill needs no writing (it only depends on the time)
            take(state, tokens)
            write_row(row, state, now)
            session.add(
                QuotaLeaseRow(
                    lease_id=lease_id,
                    tenant_id=tenant_id,
                    holder=self.holder,
                    estimated_tokens=tokens,
                    expires_at=now + self.lease_ttl_s,
                )
            )
            return headers_of(state, limits, self.window_s)

    def _now(self, session: Session) -> float:
        return db_now(session, self._clock)  # None: the database's clock

    # ---- the end of a request ----------------------------------------------------------------

    def _release(self, admission: Admission, actual_tokens: int | None) -> None:
        tokens = release_tokens(admission.estimated_tokens, actual_tokens)
        self._queue(admission, requests=0, tokens=tokens)

    def _refund(self, admission: Admission) -> None:
        self._queue(admission, requests=1, tokens=admission.estimated_tokens)

    def _queue(self, admission: Admission, *, requests: int, tokens: int) -> None:
        assert admission.lease_id is not None
        with self._mutex:
            self._held.discard(admission.lease_id)  # no longer renewed: it expires even if never deleted
            self._pending.append(_Pending(admission.tenant_id, admission.lease_id, requests, tokens))
        self._wake.set()

    def _flush(self) -> None:
        """Write the pending releases in one transaction (bucket rows locked in tenant order, so two
        replicas flushing at once cannot deadlock); on failure they stay pending. One flush at a
        time: an admission waits for the upkeep thread's flush in progress, whose releases it must see."""
        with self._flush_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        with self._mutex:
            pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            with self.sessions() as session, session.begin():
                ids = [p.lease_id for p in pending]
                session.execute(delete(QuotaLeaseRow).where(QuotaLeaseRow.lease_id.in_(ids)))
                for tenant_id in sorted({p.tenant_id for p in pending if p.requests or p.tokens}):
                    row = session.get(QuotaBucketRow, tenant_id, with_for_update=True)
                    if row is None:
                        continue
                    state = bucket_state(row)
                    for p in (p for p in pending if p.tenant_id == tenant_id):
                        give_back(state, requests=p.requests, tokens=p.tokens)
                    write_row(row, state, row.updated_at)
        except BaseException:
            with self._mutex:
                self._pending[:0] = pending
            raise

    def _renew(self) -> None:
        with self._mutex:
            held = list(self._held)
        if not held:
            return
        with self.sessions() as session, session.begin():
            expires_at = self._now(session) + self.lease_ttl_s
            session.execute(
                update(QuotaLeaseRow).where(QuotaLeaseRow.lease_id.in_(held)).values(expires_at=expires_at)
            )

    def _run(self) -> None:
        next_renewal = time.monotonic() + self.renew_every_s
        while not self._stopped.is_set():
            self._wake.wait(timeout=max(0.0, min(1.0, next_renewal - time.monotonic())))
            self._wake.clear()
            try:
                self._flush()
                if time.monotonic() >= next_renewal:
                    next_renewal = time.monotonic() + self.renew_every_s
                    self._renew()
            except Exception:  # noqa: BLE001 - retried next round; leases expire if it never works
                logger.exception("quota lease upkeep failed (retrying)")
                self._stopped.wait(1.0)

    def stop(self) -> None:
        """Write what is pending and end the upkeep thread (the drain's last step)."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        try:
            self._flush()
        except Exception:  # noqa: BLE001 - their leases expire on their own
            logger.exception("could not write %d quota releases at shutdown", len(self._pending))

    # ---- reads -------------------------------------------------------------------------------

    def num_concurrent(self, tenant_id: str) -> int:
        """Live leases of the tenant across the fleet."""
        self._flush()
        with self.sessions() as session, session.begin():
            return num_live_leases(session, tenant_id, self._now(session))

    def headers(self, tenant_id: str, quotas: TenantQuotas | None) -> dict[str, str]:
        """The tenant's `x-ratelimit-*` now (read only: nothing is written)."""
        self._flush()
        limits = self.limits(quotas)
        with self.sessions() as session, session.begin():
            row = session.get(QuotaBucketRow, tenant_id)
            now = self._now(session)
            state = TenantState() if row is None else bucket_state(row)
            refill(state, limits, max(now, row.updated_at if row else now), self.window_s)
            return headers_of(state, limits, self.window_s)


def open_limiter(settings: Settings, sessions: sessionmaker[Session], defaults: TenantQuotas) -> QuotaLimiter:
    """The fleet's limiter in the shared database with `settings.fleet`, else this process's own."""
    if settings.fleet:
        return DbQuotaLimiter(sessions, defaults, holder=settings.replica_id)
    return QuotaLimiter(defaults)
