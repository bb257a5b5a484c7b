"""Admission control: a bounded number of engine requests in flight, shared fairly, and the drain switch.

Requests beyond one full batch (`max_num_seqs`) plus the waiting queue (`max_queue_len`) are refused
at once with 503 + Retry-After instead of queueing without bound; once draining (SIGTERM) every new
request is refused the same way.

Fairness (on by default: without it one tenant can take every slot while another gets only 503s). The
slots are shared max-min fairly among the tenants that contend for them: those with requests in
flight, those refused in the last `WAITING_WINDOW_S` (they are waiting: their clients retry after
Retry-After), and the asking tenant. Each one's fair share is `max_in_flight // max(2, contenders)`:

- a tenant within its share is admitted into any free slot, and also into the `reserve`: headroom
  above `max_in_flight` that only tenants within their share may use, so that a tenant arriving at a
  server one tenant has filled is admitted at once (default `min(max_queue_len, max_in_flight // 8)`:
  the engine's waiting queue grows by at most that much);
- a tenant above its share is admitted into any free slot of the `max_in_flight` while no other
  tenant below its share is waiting. A lone tenant therefore uses the whole capacity, and a refusal
  names what limited it: the server's bound, or the share while others wait.

So a flooding tenant keeps what it holds (admission preempts nothing) but, as its requests end, their
slots go to the tenants below their share until every contender holds its share; inside the engine the
scheduler caps each tenant's running sequences at its fair share of the batch while others wait
(base_engine/fair_share.py) and orders the waiting ones by the Virtual Token Counter
(base_engine/lora_policy.py), so a newly admitted tenant's requests start at the next step.

Priority classes (api/tenancy/priority.py): `priority_reserve` slots of `max_in_flight` (default 1/8)
are kept for the most urgent level seen so far (from the default level 0 at start, lower if a more
urgent request came): a request of a less urgent level is refused (503) once that few slots are
left, so a flood of background work cannot hold the slots an urgent request needs. Inside the
engine the levels are served strictly (base_engine/priority.py).

`admit` is the request path's admission step: the tenant's quotas (429), then this bound (503),
then the meter's `begin`; the `Ticket` it returns gives the slot and the quota back once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from api.context import RequestContext, Usage
from api.errors import APIError, request_id_in_use
from api.metering.meter import DuplicateRequestId
from api.metering.request_meter import Meter
from api.tenancy.quota_gate import NOT_ADMITTED, Quotas, Release, release_nothing

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
WAITING_WINDOW_S = 5.0  # a refused tenant counts as waiting for a slot this long (a few Retry-Afters)


class Ticket:
    """Held while a request's engine requests are in flight; `release` and `end` are idempotent.

    The slot goes back with `release`. The tenant's quota goes back once, with the first known usage:
    `release(usage)` when the response knew it, else `end(usage)` from the request's end in the engine
    (the figure metering bills), so a request cut off before its usage was known (disconnect,
    timeout) is not charged its whole estimate.
    """

    def __init__(self, admission: Admission, num: int, tenant: str | None = None) -> None:
        self._admission = admission
        self.num = num
        self.tenant = tenant
        self.release_quota: Release = release_nothing  # the tenant's quotas, set by `admit`
        self._released = False
        self._quota_released = False
        self._quota_lock = threading.Lock()

    def release(self, usage: Usage | None = None) -> None:
        """Give the slot back, and the quota too when `usage` is known."""
        if not self._released:
            self._released = True
            self._admission._release(self.num, self.tenant)
        if usage is not None:
            self.end(usage)

    def end(self, usage: Usage) -> None:
        """The request's end with its final usage: gives the tenant's quota back (once)."""
        with self._quota_lock:
            if self._quota_released:
                return
            self._quota_released = True
        try:
            self.release_quota(usage)
        except Exception:  # noqa: BLE001 - a failing quota release must not break the request's end
            logger.exception("quota release failed")


class Admission:
    def __init__(
        self,
        max_in_flight: int,
        *,
        fair: bool = True,
        reserve: int | None = None,
        max_queue_len: int | None = None,
        priority_reserve: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self.is_draining = False
        self.fair = fair
        if reserve is None:
            queue = max_in_flight if max_queue_len is None else max_queue_len
            reserve = min(queue, max_in_flight // 8)
        self.reserve = reserve if fair else 0
        # Slots only the most urgent level seen (`top_priority`) may take.
        self.priority_reserve = max_in_flight // 8 if priority_reserve is None else priority_reserve
        self.top_priority = 0
        self._clock = clock
        self._by_tenant: dict[str | None, int] = {}
        self._waiting: dict[str | None, float] = {}  # refused tenant -> when it stops counting as waiting
        self._lock = threading.Lock()

    def in_flight_by_tenant(self) -> dict[str | None, int]:
        with self._lock:
            return dict(self._by_tenant)

    def _share(self, tenant: str | None, now: float) -> int:
        # Caller holds the lock.
        for t, until in list(self._waiting.items()):
            if until <= now:
                del self._waiting[t]
        contenders = set(self._by_tenant) | set(self._waiting) | {tenant}
        return max(1, self.max_in_flight // max(2, len(contenders)))

    def _refusal(self, tenant: str | None, num: int, now: float, priority: int = 0) -> str | None:
        """Why `num` more engine requests of `tenant` cannot be admitted now, or None. Holds the lock."""
        total = self.num_in_flight + num
        self.top_priority = min(self.top_priority, priority)
        if priority > self.top_priority and total > self.max_in_flight - self.priority_reserve:
            return (
                f"The server is busy: {self.priority_reserve} of its {self.max_in_flight} request slots are "
                f"kept for priority {self.top_priority} and this request's priority is {priority} (lower = "
                f"more urgent); retry later."
            )
        if not self.fair:
            return None if total <= self.max_in_flight else self._overloaded(self.max_in_flight)
        share = self._share(tenant, now)
        holding = self._by_tenant.get(tenant, 0)
        if holding + num <= share:  # within its share: the reserve above the bound is open to it
            limit = self.max_in_flight + self.reserve
            return None if total <= limit else self._overloaded(limit)
        if total > self.max_in_flight:
            return self._overloaded(self.max_in_flight)
        waiting = [t for t in self._waiting if t != tenant and self._by_tenant.get(t, 0) < share]
        if not waiting:
            return None
        return (
            f"The server is busy: this tenant holds {holding} of {self.max_in_flight} request slots and its "
            f"fair share is {share} while {len(waiting)} other tenant(s) below their share wait; retry later."
        )

    def _overloaded(self, limit: int) -> str:
        return (
            f"The server is overloaded ({self.num_in_flight} requests in flight, limit {limit}); retry later."
        )

    def acquire(self, num: int, tenant: str | None = None, priority: int = 0) -> Ticket:
        """Admit `num` engine requests of `tenant` at `priority` or raise 503 (overloaded, over its fair
        share while others wait, into the slots kept for more urgent requests, or shutting down)."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        with self._lock:
            if self.is_draining:
                raise APIError(
                    503, "The server is shutting down; retry later.", code="shutting_down", headers=retry
                )
            if num > self.max_in_flight:
                raise APIError(
                    400,
                    f"request needs {num} engine requests (prompts x n), more than this server admits "
                    f"at once ({self.max_in_flight})",
                    param="n",
                    code="invalid_value",
                )
            now = self._clock()
            refusal = self._refusal(tenant, num, now, priority)
            if refusal is not None:
                self._waiting[tenant] = now + WAITING_WINDOW_S
                raise APIError(503, refusal, code="overloaded", headers=retry)
            self._waiting.pop(tenant, None)
            self.num_in_flight += num
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + num
        return Ticket(self, num, tenant)

    def _release(self, num: int, tenant: str | None = None) -> None:
        with self._lock:
            self.num_in_flight -= num
            left = self._by_tenant.get(tenant, 0) - num
            if left > 0:
                self._by_tenant[tenant] = left
            else:
                self._by_tenant.pop(tenant, None)


def admit(
    *, quotas: Quotas, admission: Admission, meter: Meter, ctx: RequestContext, num_requests: int
) -> Ticket:
    """The tenant's quotas (429), then the server's own bound (503); once admitted, metering begins
    (409 when the tenant has this request id in flight). A 503 or 409 after the quotas admitted gives
    the tenant's allowance back (`NOT_ADMITTED`)."""
    release_quota = quotas.admit(ctx)
    try:
        ticket = admission.acquire(num_requests, ctx.tenant_id, ctx.priority)
    except BaseException:
        release_quota(NOT_ADMITTED)
        raise
    try:
        meter.begin(ctx)
    except DuplicateRequestId:  # the tenant has this X-Request-Id in flight: nothing was admitted
        ticket.release()
        release_quota(NOT_ADMITTED)
        raise request_id_in_use(ctx.client_id or ctx.request_id) from None
    ticket.release_quota = release_quota
    ctx.on_end.append(ticket.end)  # the request's end gives the quota back with what it billed
    return ticket
