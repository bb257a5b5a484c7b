"""Issue 7 wired into the app through `AppState`'s seams: quotas, usage metering, Prometheus metrics.

What is metered (one `UsageRecord` per HTTP request, keyed by its request id = response `id` =
`X-Request-Id`):
- every request that passed admission (quotas, then the server's in-flight bound): `begin` when it
  is admitted, `finish` when its last engine request has ended, for any reason (finished, stopped,
  aborted by a disconnect, timeout or shutdown, failed in the engine). Its tokens are exactly the
  response's `usage` (`api.context.compute_usage` over the final outputs): each prompt once, cached
  prompt tokens of the first choice, completion tokens of every choice. An admitted request pays
  for its prompt even when it is aborted before the engine ran it. While a stream runs, `progress`
  notes the tokens it has sent (`on_progress`), so that after a crash recovery bills the prompt and
  what was streamed up to ~0.5 s before it (api/metering/meter.py).
- not requests refused before admission: 400 (validation, context length), 401, 404, 429 (quota)
  and 503 (overload, draining) never reach the engine and are not billed, as OpenAI does not bill
  them (../shared/reference/platform.md section 1.4).

Metrics name no tenant unless asked (`metrics_tenant_labels`, or the metrics token on the scrape:
api/routes/usage.py). Quotas are checked before any engine work; the 429 carries `Retry-After`
(whole seconds, rounded up), `retry-after-ms`, `x-ratelimit-*` and `x-should-retry: false` when
waiting cannot help.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from datetime import UTC, datetime

from api.context import RequestContext, Usage, compute_usage
from api.errors import APIError
from api.metering.meter import UsageMeter
from api.metrics.prometheus import Metrics
from api.state import AppState
from api.tenancy.admission import NOT_ADMITTED, Release
from api.tenancy.quotas import QuotaExceededError
from api.tenancy.quotas_db import open_limiter
from base_engine.outputs import RequestOutput
from registry.types import TenantQuotas
from registry.usage import UsageRecord

logger = logging.getLogger(__name__)

JOURNAL_FILE = "usage.journal"
METRICS_INTERVAL_S = 1.0
# When one HTTP request's choices ended differently, the record keeps the most telling reason.
_REASON_ORDER = ("error", "abort", "length", "stop")


def install(state: AppState) -> None:
    """Create the meter (replaying a crashed run's journal first), metrics and limiter; hook them in."""
    settings = state.settings
    meter = UsageMeter(
        state.sessions,
        journal_path=settings.data_dir / JOURNAL_FILE,
        flush_interval_s=settings.usage_flush_interval_s,
    )
    recovered = meter.recover()
    if recovered:
        logger.warning("billed %d requests left unwritten by the previous run", recovered)
    meter.start()
    state.meter = meter
    state.metrics = Metrics(
        model_name=state.model_name,
        max_model_len=state.max_model_len,
        tenant_labels=settings.metrics_tenant_labels,
    )
    kv_cache = state.engine.kv_cache
    state.metrics.set_cache_config(
        block_size=kv_cache.block_size,
        num_gpu_blocks=kv_cache.num_blocks,
        cache_dtype="auto",  # the KV cache has the model's dtype, vLLM's "auto"
        enable_prefix_caching=kv_cache.enable_prefix_caching,
    )
    defaults = TenantQuotas(
        rpm=settings.default_rpm, tpm=settings.default_tpm, max_concurrent=settings.default_max_concurrent
    )
    state.quotas = open_limiter(settings, state.sessions, defaults)  # a fleet's lives in the database
    sampler = MetricsSampler(state)
    sampler.start()
    state.plan_checks.append(functools.partial(precheck_quota, state))
    state.admission_checks.append(functools.partial(check_quota, state))
    state.on_admitted.append(functools.partial(begin_usage, state))
    state.on_progress.append(functools.partial(note_progress, state))
    state.inflight.on_request_finished.append(functools.partial(finish_usage, state))
    state.on_drain.append(sampler.stop)
    state.on_drain.append(meter.stop)  # after the drain: every admitted request has finished
    state.on_drain.append(state.quotas.stop)  # the database backend writes its pending releases


def precheck_quota(state: AppState, tenant_id: str, quotas: TenantQuotas | None) -> None:
    """The plan check: 429 at once for a tenant that no request could be admitted for right now."""
    assert state.quotas is not None
    try:
        state.quotas.precheck(tenant_id, quotas)
    except QuotaExceededError as exc:
        error = quota_error(exc)
        error.headers = {**exc.headers, **error.headers}
        raise error from None


def check_quota(state: AppState, ctx: RequestContext) -> Release:
    """The admission check: take the tenant's limits or refuse with 429; headers go on the response."""
    assert state.quotas is not None
    limiter = state.quotas
    try:
        admission = limiter.admit(ctx.tenant_id, ctx.quotas, estimated_tokens=ctx.estimated_tokens)
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


def quota_error(exc: QuotaExceededError) -> APIError:
    headers = {
        "Retry-After": str(max(1, math.ceil(exc.retry_after_s))),
        "retry-after-ms": str(max(1, math.ceil(exc.retry_after_s * 1000))),
    }
    if not exc.is_retryable:
        headers["x-should-retry"] = "false"
    code = "rate_limit_exceeded" if exc.is_retryable else "insufficient_quota"
    return APIError(429, exc.message, code=code, param=exc.limit, headers=headers)


def begin_usage(state: AppState, ctx: RequestContext) -> None:
    """`on_admitted`: journal the request, so a crash before it ends still bills its prompt."""
    assert state.meter is not None
    try:
        state.meter.begin(
            ctx.request_id,
            tenant_id=ctx.tenant_id,
            key_prefix=ctx.key_prefix,
            prompt_tokens=ctx.num_prompt_tokens,
            adapter_name=ctx.adapter_name,
            adapter_version=ctx.adapter_version,
            created_at=ctx.created_at,
            user=ctx.user,
            provenance=ctx.provenance,
        )
    except (OSError, RuntimeError, ValueError):  # the request is still billed when it finishes
        logger.exception("could not journal request %s", ctx.request_id)


def note_progress(state: AppState, ctx: RequestContext, usage: Usage) -> None:
    """`on_progress`: what a stream has sent so far, journaled by the meter's own thread (crash bound)."""
    assert state.meter is not None
    state.meter.progress(
        ctx.request_id, completion_tokens=usage.completion_tokens, cached_prompt_tokens=usage.cached_tokens
    )


def usage_record(ctx: RequestContext, finals: list[RequestOutput], *, finished_at: datetime) -> UsageRecord:
    """The billed record of one HTTP request: the same numbers as its response's `usage`."""
    usage = compute_usage(finals, n=ctx.n)
    reasons = {o.finish_reason or "abort" for o in finals}
    reason = next((r for r in _REASON_ORDER if r in reasons), sorted(reasons)[0])
    timed = [o.metrics for o in finals if o.metrics is not None]
    first_tokens = [o.metrics.ttft_s for o in finals if o.metrics is not None and o.num_completion_tokens]
    return UsageRecord(
        request_id=ctx.request_id,
        tenant_id=ctx.tenant_id,
        key_prefix=ctx.key_prefix,
        adapter_name=ctx.adapter_name,
        adapter_version=ctx.adapter_version,
        prompt_tokens=usage.prompt_tokens,
        cached_prompt_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        finish_reason=reason,
        queue_time_s=min((m.queue_time_s for m in timed), default=0.0),
        ttft_s=min(first_tokens, default=None),
        total_time_s=max(0.0, (finished_at - ctx.created_at).total_seconds()),
        created_at=ctx.created_at,
        finished_at=finished_at,
        user=ctx.user,
        provenance=ctx.provenance,
    )


def finish_usage(state: AppState, ctx: RequestContext, finals: list[RequestOutput]) -> None:
    """`inflight.on_request_finished`: bill the request once and count its engine requests."""
    assert state.meter is not None and state.metrics is not None
    try:
        state.meter.finish(usage_record(ctx, finals, finished_at=datetime.now(UTC)))
    except RuntimeError:  # finished after the meter stopped (shutdown): its journaled begin bills it
        logger.warning("request %s finished after the usage meter stopped", ctx.request_id)
    adapter = f"{ctx.adapter_name}@{ctx.adapter_version}" if ctx.adapter_name else None
    for out in finals:
        state.metrics.observe_finished(out, tenant=ctx.tenant_name, adapter=adapter)
    state.metrics.observe_request(finals)


class MetricsSampler:
    """Refreshes the engine gauges and the recent-samples ring every second, off the request path."""

    def __init__(self, state: AppState, interval_s: float = METRICS_INTERVAL_S) -> None:
        self.state = state
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraserve-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                refresh_engine_metrics(self.state)
            except Exception:  # noqa: BLE001 - metrics must never take the server down
                logger.exception("metrics refresh failed")


def refresh_engine_metrics(state: AppState) -> None:
    if state.metrics is not None:
        disk = state.disk
        state.metrics.update_engine(
            state.engine.stats(), disk_count=len(disk.entries()), disk_bytes=disk.num_bytes
        )
