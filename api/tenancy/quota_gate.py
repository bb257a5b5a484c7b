"""The rate limits as the request path sees them: `precheck` before planning, `admit` before any engine
work, each refusing with the OpenAI-shaped 429.

`Quotas` is what planning and admission call; `TenantQuotaGate` puts the tenant's limiter behind it
(api/tenancy/quotas.py in one process, api/tenancy/quotas_db.py in a fleet) and `NoQuotas` admits
everything (a server or test built without rate limits). The 429 carries `Retry-After` (whole
seconds, rounded up), `retry-after-ms`, `x-ratelimit-*` and `x-should-retry: false` when waiting
cannot help.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from api.context import RequestContext, Usage
from api.errors import APIError
from api.tenancy.quotas import QuotaExceededError, QuotaLimiter
from registry.types import TenantQuotas

Release = Callable[[Usage | None], None]  # called once when the request ends, with its usage if known
# The usage a release is called with when the request was refused after its quotas admitted it (the
# server's 503): nothing ran, so nothing is owed (quotas give everything back).
NOT_ADMITTED = Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0)


class Quotas(Protocol):
    def precheck(self, tenant_id: str, quotas: TenantQuotas | None) -> None:
        """Raise the 429 at once for a tenant no request could be admitted for now; takes nothing."""

    def admit(self, ctx: RequestContext) -> Release:
        """Take the tenant's limits for `ctx` or raise 429; the rate-limit headers go on
        `ctx.response_headers`. The release runs once when the request ends (`NOT_ADMITTED`: refused
        later, everything comes back)."""

    def stop(self) -> None:
        """At shutdown, after the drain: write what is pending (the database backend's releases)."""


class NoQuotas:
    """No rate limits: every request passes, nothing is held."""

    def precheck(self, tenant_id: str, quotas: TenantQuotas | None) -> None:
        return None

    def admit(self, ctx: RequestContext) -> Release:
        return release_nothing

    def stop(self) -> None:
        return None


def release_nothing(usage: Usage | None) -> None:
    return None


class TenantQuotaGate:
    """The tenants' rpm / tpm / concurrency limits from `limiter`, refusals as HTTP errors."""

    def __init__(self, limiter: QuotaLimiter) -> None:
        self.limiter = limiter

    def precheck(self, tenant_id: str, quotas: TenantQuotas | None) -> None:
        try:
            self.limiter.precheck(tenant_id, quotas)
        except QuotaExceededError as exc:
            error = quota_error(exc)
            error.headers = {**exc.headers, **error.headers}
            raise error from None

    def admit(self, ctx: RequestContext) -> Release:
        try:
            admission = self.limiter.admit(ctx.tenant_id, ctx.quotas, estimated_tokens=ctx.estimated_tokens)
        except QuotaExceededError as exc:
            ctx.response_headers.update(exc.headers)  # the state the decision saw (one database transaction)
            raise quota_error(exc) from None
        ctx.response_headers.update(admission.headers)

        def release(usage: Usage | None) -> None:
            if usage is NOT_ADMITTED:
                admission.refund()  # refused later (503): it does not count against the tenant's limits
            else:
                admission.release(usage.total_tokens if usage is not None else None)

        return release

    def stop(self) -> None:
        self.limiter.stop()


def quota_error(exc: QuotaExceededError) -> APIError:
    headers = {
        "Retry-After": str(max(1, math.ceil(exc.retry_after_s))),
        "retry-after-ms": str(max(1, math.ceil(exc.retry_after_s * 1000))),
    }
    if not exc.is_retryable:
        headers["x-should-retry"] = "false"
    code = "rate_limit_exceeded" if exc.is_retryable else "insufficient_quota"
    return APIError(429, exc.message, code=code, param=exc.limit, headers=headers)
