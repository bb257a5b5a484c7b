"""The requests now in the engine, and the one place an HTTP request's end is reported.

`InFlight` maps engine request ids to their `RequestContext` (so the drain can abort what is left)
and is the single observer api registers on `AsyncEngine.on_finished`. When the last engine request
of an HTTP request has ended (finished, aborted, failed, or `discard`ed: never submitted, so aborted
with no tokens), it calls, in this order, `meter.finish` (bill it once) and `metrics.request_finished`
with the final outputs in choice order, on the engine's dispatcher thread (or the caller's, for
`discard`). The meter runs first so usage reads right after a response see its record; then the
context's `on_end` hooks get the same usage the meter billed (the tenant's quota is corrected with
it, also when the client left before its usage was known).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from api.context import RequestContext, compute_usage
from api.metering.request_meter import Meter
from api.metrics.recorder import MetricsRecorder
from base_engine.async_engine import EngineRequest
from base_engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class InFlight:
    """Contexts of the requests now in the engine, by engine request id. Thread-safe."""

    def __init__(self, *, meter: Meter, metrics: MetricsRecorder) -> None:
        self._meter = meter
        self._metrics = metrics
        self._by_engine_id: dict[str, RequestContext] = {}
        self._finals: dict[str, dict[str, RequestOutput]] = {}  # ctx.engine_key -> engine id -> final
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_engine_id)

    def add(self, ctx: RequestContext) -> None:
        with self._lock:
            self._finals[ctx.engine_key] = {}
            for eid in ctx.engine_request_ids:
                self._by_engine_id[eid] = ctx

    def get(self, engine_request_id: str) -> RequestContext | None:
        with self._lock:
            return self._by_engine_id.get(engine_request_id)

    def discard(self, request: EngineRequest) -> None:
        never_ran = RequestOutput(request.request_id, request.prompt_token_ids, [], "", finish_reason="abort")
        self.on_engine_finished(never_ran)

    def on_engine_finished(self, out: RequestOutput) -> None:
        """An engine request has ended; the last one of its HTTP request reports the request's end."""
        with self._lock:
            ctx = self._by_engine_id.pop(out.request_id, None)
            if ctx is None:
                return
            finals = self._finals[ctx.engine_key]
            finals[out.request_id] = out
            if len(finals) < len(ctx.engine_request_ids):
                return
            del self._finals[ctx.engine_key]
        self._request_finished(ctx, [finals[eid] for eid in ctx.engine_request_ids])

    def _request_finished(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        # Runs on the engine's dispatcher thread: never let it raise.
        try:
            self._meter.finish(ctx, finals)
        except Exception:  # noqa: BLE001
            logger.exception("metering failed for request %s", ctx.request_id)
        self._run_end_hooks(ctx, finals)
        try:
            self._metrics.request_finished(ctx, finals)
        except Exception:  # noqa: BLE001
            logger.exception("metrics failed for request %s", ctx.request_id)

    def _run_end_hooks(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        try:
            usage = compute_usage(finals, n=ctx.n)
            for hook in ctx.on_end:
                hook(usage)
        except Exception:  # noqa: BLE001
            logger.exception("end hooks failed for request %s", ctx.request_id)

    def abort_all(self, reason: str, abort: Callable[[str], None]) -> int:
        """Abort every in-flight engine request with `abort(engine_request_id)`; returns how many."""
        with self._lock:
            items = list(self._by_engine_id.items())
        for eid, ctx in items:
            ctx.abort_reason = ctx.abort_reason or reason
            abort(eid)
        if items:
            logger.info("aborted %d in-flight engine requests (%s)", len(items), reason)
        return len(items)
