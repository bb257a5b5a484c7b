"""Metering as the request path calls it: `begin` once admitted, `progress` as a stream sends,
`finish` when its last engine request has ended.

What is metered (one `UsageRecord` per HTTP request, keyed by its tenant and its request id =
response `id`): every request that passed admission, for any end (finished, stopped, aborted by a
disconnect, timeout or shutdown, failed in the engine). Its tokens are exactly the response's `usage`
(`api.context.compute_usage` over the final outputs): each prompt once, cached prompt tokens of the
first choice, completion tokens of every choice. An admitted request pays for its prompt even when it
is aborted before the engine ran it; after a crash, recovery bills the prompt and what a stream had
sent up to ~0.5 s before it (api/metering/meter.py). Requests refused before admission (400, 401,
404, 429, 503) are not billed, as OpenAI does not bill them.

`RequestMeter` journals and writes through a `UsageMeter`; `NoMeter` bills nothing (a server or test
built without metering).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from api.context import RequestContext, Usage, compute_usage
from api.metering.journal import InFlightRequest
from api.metering.meter import DuplicateRequestId, UsageMeter
from base_engine.outputs import RequestOutput
from registry.usage import UsageRecord

logger = logging.getLogger(__name__)

JOURNAL_FILE = "usage.journal"
# When one HTTP request's choices ended differently, the record keeps the most telling reason.
_REASON_ORDER = ("error", "abort", "length", "stop")


class Meter(Protocol):
    def begin(self, ctx: RequestContext) -> None:
        """The request was admitted: journal it, so a crash before it ends still bills its prompt.
        Raises `DuplicateRequestId` when its tenant already has that request id in flight."""

    def progress(self, ctx: RequestContext, usage: Usage) -> None:
        """What a stream has handed its client so far; runs on the event loop, must not block."""

    def finish(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        """Bill the request once; its final outputs in choice order. Runs on the engine's dispatcher."""

    def flush(self) -> None:
        """Write every finished record now (a usage read includes everything finished before it)."""

    def stop(self) -> None:
        """At shutdown, after the drain (every admitted request has finished): write what is left."""


class NoMeter:
    """Bills nothing."""

    def begin(self, ctx: RequestContext) -> None:
        return None

    def progress(self, ctx: RequestContext, usage: Usage) -> None:
        return None

    def finish(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        return None

    def flush(self) -> None:
        return None

    def stop(self) -> None:
        return None


class RequestMeter:
    """Requests' usage through the journaled, batched `UsageMeter`."""

    def __init__(self, usage: UsageMeter) -> None:
        self.usage = usage

    def begin(self, ctx: RequestContext) -> None:
        try:
            self.usage.begin(
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
        except DuplicateRequestId:  # admission refuses it with a 409 (api/tenancy/admission.py)
            raise
        except (OSError, RuntimeError, ValueError):  # the request is still billed when it finishes
            logger.exception("could not journal request %s", ctx.request_id)

    def progress(self, ctx: RequestContext, usage: Usage) -> None:
        self.usage.progress(
            ctx.request_id,
            tenant_id=ctx.tenant_id,
            completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_tokens,
        )

    def finish(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        try:
            self.usage.finish(usage_record(ctx, finals, finished_at=datetime.now(UTC)))
        except RuntimeError:  # finished after the meter stopped (shutdown): its journaled begin bills it
            logger.warning("request %s finished after the usage meter stopped", ctx.request_id)

    def in_flight(self, request_id: str, *, tenant_id: str) -> InFlightRequest | None:
        return self.usage.in_flight(request_id, tenant_id=tenant_id)

    def flush(self) -> None:
        self.usage.flush()

    def stop(self) -> None:
        self.usage.stop()


def open_meter(sessions: sessionmaker[Session], *, data_dir: Path, flush_interval_s: float) -> RequestMeter:
    """The meter of this data dir, started, after billing what a crashed run left unwritten."""
    usage = UsageMeter(sessions, journal_path=data_dir / JOURNAL_FILE, flush_interval_s=flush_interval_s)
    recovered = usage.recover()
    if recovered:
        logger.warning("billed %d requests left unwritten by the previous run", recovered)
    usage.start()
    return RequestMeter(usage)


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
