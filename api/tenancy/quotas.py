"""Per-tenant rate limits: requests per minute, tokens per minute, concurrent requests.

Requests and tokens are token buckets that refill continuously (capacity = the per-minute limit,
refilled at limit/60 per second), the model OpenAI describes for its own limits; admission takes
one request and the request's estimated tokens (prompt + max_tokens for every choice), and
`Admission.release(actual_tokens)` gives back what the estimate over-counted. Limits come from the
tenant's `TenantQuotas` (set by the admin API) with None falling back to the server defaults, and
None there means unlimited; a limit of 0 blocks the tenant. Stored adapters and adapter bytes are
enforced by the registry at upload (registry/adapters.py), not here.

Refusals follow ../shared/reference/platform.md section 6.6: 429 with `Retry-After` and an error
naming the limit, and `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers in OpenAI's
format (reset as a Go duration, e.g. "1s", "6m0s"). A request that can never pass (more tokens than
the whole per-minute limit, or a limit of 0) is marked not retryable (`x-should-retry: false`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from registry.types import TenantQuotas

# How long to suggest waiting when only the concurrency limit refused: the time a slot frees is
# unknown, and the OpenAI client backs off from 0.5 s.
CONCURRENCY_RETRY_S = 1.0
_LIMIT_NAMES = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "max_concurrent": "concurrent requests",
}


class QuotaExceededError(Exception):
    def __init__(self, limit: str, retry_after_s: float, message: str, *, is_retryable: bool = True) -> None:
        super().__init__(message)
        self.limit = limit  # "rpm" | "tpm" | "max_concurrent" (TenantQuotas field names)
        self.retry_after_s = retry_after_s
        self.message = message
        self.is_retryable = is_retryable
        self.headers: dict[str, str] = {}  # the tenant's x-ratelimit-* when it was refused


def format_duration(seconds: float) -> str:
    """Go's time.Duration spelling, as OpenAI's reset headers use: "20ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@dataclass(slots=True)
class Bucket:
    capacity: float
    level: float
    updated_at: float

    def refill(self, now: float, capacity: float, window_s: float) -> None:
        # A lowered limit caps what is left at once; a raised one fills at the new rate.
        self.capacity = capacity
        self.level = min(capacity, self.level + (now - self.updated_at) * capacity / window_s)
        self.updated_at = now

    def wait_for(self, amount: float, window_s: float) -> float:
        """Seconds until `amount` is available (0 when it is now)."""
        return max(0.0, (amount - self.level) * window_s / self.capacity)


@dataclass(slots=True)
class TenantState:
    """One tenant's counters; the in-memory backend keeps them in a dict, api/tenancy/quotas_db.py in rows."""

    requests: Bucket | None = None
    tokens: Bucket | None = None
    num_concurrent: int = 0


@dataclass(frozen=True, slots=True)
class Limits:
    """Effective limits of one tenant; None = unlimited."""

    rpm: int | None
    tpm: int | None
    max_concurrent: int | None


@dataclass(slots=True)
class Admission:
    """Held while the request runs; `release` once (later calls do nothing)."""

    limiter: QuotaLimiter
    tenant_id: str
    estimated_tokens: int
    is_released: bool = field(default=False)
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* right after this admission
    lease_id: str | None = None  # the database backend's concurrency lease

    def release(self, actual_tokens: int | None = None) -> None:
        """End the request; with `actual_tokens`, return the estimate's excess to the token bucket."""
        if not self.is_released:
            self.is_released = True
            self.limiter._release(self, actual_tokens)

    def refund(self) -> None:
        """The request was refused after this admission (e.g. 503, server overloaded) and never ran:
        give back its concurrency slot, its request and its whole token estimate."""
        if not self.is_released:
            self.is_released = True
            self.limiter._refund(self)


# ---- the rules, on a TenantState: shared by the in-memory and the database backend -------------


def refill(state: TenantState, limits: Limits, now: float, window_s: float) -> None:
    """Bring the buckets to `now` under the current limits (created, resized or dropped as needed)."""
    for attr, limit in (("requests", limits.rpm), ("tokens", limits.tpm)):
        bucket = getattr(state, attr)
        if limit is None or limit == 0:
            # Unlimited needs no bucket; 0 is refused by `check` before any bucket is read.
            setattr(state, attr, None if limit is None else Bucket(0.0, 0.0, now))
        elif bucket is None or bucket.capacity == 0:
            setattr(state, attr, Bucket(float(limit), float(limit), now))
        else:
            bucket.refill(now, float(limit), window_s)


def check(tenant_id: str, limits: Limits, state: TenantState, tokens: int, window_s: float) -> None:
    """Raise QuotaExceededError when one more request of `tokens` does not fit `state` now."""
    if limits.max_concurrent is not None and state.num_concurrent >= limits.max_concurrent:
        maximum, running = limits.max_concurrent, f"{state.num_concurrent} running"
        raise _refusal(
            tenant_id, "max_concurrent", maximum, running, CONCURRENCY_RETRY_S, is_retryable=maximum > 0
        )
    for name, bucket, need, limit in (
        ("rpm", state.requests, 1, limits.rpm),
        ("tpm", state.tokens, tokens, limits.tpm),
    ):
        if bucket is None or limit is None:
            continue
        if need > limit:  # can never fit, however long the client waits
            used = f"this request needs {need}"
            raise _refusal(tenant_id, name, limit, used, window_s, is_retryable=False)
        if bucket.level < need:
            used = f"{max(0, math.floor(bucket.level))} left, this request needs {need}"
            raise _refusal(tenant_id, name, limit, used, bucket.wait_for(need, window_s))


def take(state: TenantState, tokens: int) -> None:
    """Admit: one concurrency slot, one request and `tokens` from the buckets."""
    state.num_concurrent += 1
    if state.requests is not None:
        state.requests.level -= 1
    if state.tokens is not None:
        state.tokens.level -= tokens


def give_back(state: TenantState, *, requests: int, tokens: int) -> None:
    """Return `requests` and `tokens` to the buckets (never above capacity; a 0-limit bucket stays 0)."""
    for bucket, amount in ((state.requests, requests), (state.tokens, tokens)):
        if bucket is not None and bucket.capacity > 0 and amount:
            bucket.level = min(bucket.capacity, bucket.level + amount)


def release_tokens(estimated_tokens: int, actual_tokens: int | None) -> int:
    """Tokens a release gives back: what the estimate over-counted (0 when the usage is unknown)."""
    return 0 if actual_tokens is None else estimated_tokens - actual_tokens


def headers_of(state: TenantState, limits: Limits, window_s: float) -> dict[str, str]:
    """`x-ratelimit-*` of a refilled `state`."""
    out: dict[str, str] = {}
    kinds = (("requests", state.requests, limits.rpm), ("tokens", state.tokens, limits.tpm))
    for kind, bucket, limit in kinds:
        if bucket is None or limit is None:
            continue
        out[f"x-ratelimit-limit-{kind}"] = str(limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
        reset = bucket.wait_for(bucket.capacity, window_s) if bucket.capacity else window_s
        out[f"x-ratelimit-reset-{kind}"] = format_duration(reset)
    return out


class QuotaLimiter:
    """The in-memory backend: one process's counters. api/tenancy/quotas_db.py is the fleet's, same rules."""

    def __init__(
        self,
        defaults: TenantQuotas | None = None,
        *,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.defaults = defaults or TenantQuotas()
        self.window_s = window_s
        self.clock = clock
        self._tenants: dict[str, TenantState] = {}
        self._lock = threading.Lock()

    def limits(self, quotas: TenantQuotas | None) -> Limits:
        q, d = quotas or TenantQuotas(), self.defaults
        return Limits(
            rpm=q.rpm if q.rpm is not None else d.rpm,
            tpm=q.tpm if q.tpm is not None else d.tpm,
            max_concurrent=q.max_concurrent if q.max_concurrent is not None else d.max_concurrent,
        )

    def admit(self, tenant_id: str, quotas: TenantQuotas | None, *, estimated_tokens: int) -> Admission:
        """Take one request and `estimated_tokens` from the tenant's limits, or raise QuotaExceededError
        (with the tenant's `headers`); the admission carries the headers after it."""
        if estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be >= 0, got {estimated_tokens}")
        limits = self.limits(quotas)
        with self._lock:
            state = self._refill(tenant_id, limits)
            try:
                check(tenant_id, limits, state, estimated_tokens, self.window_s)
            except QuotaExceededError as exc:
                exc.headers = headers_of(state, limits, self.window_s)
                raise
            take(state, estimated_tokens)
            headers = headers_of(state, limits, self.window_s)
        return Admission(self, tenant_id, estimated_tokens, headers=headers)

    def precheck(self, tenant_id: str, quotas: TenantQuotas | None) -> None:
        """Raise QuotaExceededError (with headers) when no request of this tenant could be admitted now:
        no concurrency slot, no request or no token left. Takes nothing (`admit` decides); lets the
        server refuse before it spends any work (tokenizing, compiling a grammar) on the request."""
        limits = self.limits(quotas)
        with self._lock:
            state = self._refill(tenant_id, limits)
            try:
                check(tenant_id, limits, state, 1, self.window_s)  # any request needs >= 1 token
            except QuotaExceededError as exc:
                exc.headers = headers_of(state, limits, self.window_s)
                raise

    def _refill(self, tenant_id: str, limits: Limits) -> TenantState:
        state = self._tenants.setdefault(tenant_id, TenantState())
        refill(state, limits, self.clock(), self.window_s)
        return state

    def _release(self, admission: Admission, actual_tokens: int | None) -> None:
        with self._lock:
            state = self._tenants[admission.tenant_id]
            state.num_concurrent -= 1
            give_back(state, requests=0, tokens=release_tokens(admission.estimated_tokens, actual_tokens))

    def _refund(self, admission: Admission) -> None:
        with self._lock:
            state = self._tenants[admission.tenant_id]
            state.num_concurrent -= 1
            give_back(state, requests=1, tokens=admission.estimated_tokens)

    def num_concurrent(self, tenant_id: str) -> int:
        with self._lock:
            state = self._tenants.get(tenant_id)
            return 0 if state is None else state.num_concurrent

    def headers(self, tenant_id: str, quotas: TenantQuotas | None) -> dict[str, str]:
        """`x-ratelimit-*` headers of the tenant's state now (after any admission just made)."""
        limits = self.limits(quotas)
        with self._lock:
            return headers_of(self._refill(tenant_id, limits), limits, self.window_s)

    def stop(self) -> None:
        """Nothing to flush in memory (the database backend writes its pending releases here)."""


def _refusal(
    tenant_id: str, limit: str, value: int, state: str, retry_after_s: float, *, is_retryable: bool = True
) -> QuotaExceededError:
    what = f"{_LIMIT_NAMES[limit]} ({limit})"
    message = f"Rate limit reached for {what} of tenant {tenant_id}: limit {value}, {state}."
    if is_retryable:
        message += f" Please try again in {format_duration(retry_after_s)}."
    else:
        message += " This request cannot succeed under the current limit; ask the operator to raise it."
    return QuotaExceededError(limit, retry_after_s, message, is_retryable=is_retryable)
