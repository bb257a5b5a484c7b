"""Running a planned completion: submit every engine request, merge their outputs, enforce the
per-request timeout, and abort whatever is unfinished when the consumer goes away (disconnect,
timeout, error), so that KV blocks and adapter pins are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request

from api.context import RequestContext
from api.errors import APIError
from api.inference.inflight import InFlight
from api.inference.planning import GenerationPlan
from base_engine.async_engine import AsyncEngine, EngineRequest, failed_output
from base_engine.outputs import RequestOutput

T = TypeVar("T")


class RequestTimeout(Exception):
    pass


async def run_choices(
    *, engine: AsyncEngine, inflight: InFlight, timeout_s: float, plan: GenerationPlan
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every engine request of the plan, as they come.

    Leaving early (consumer closed or cancelled, timeout) aborts the unfinished engine requests at
    once, so their KV blocks and adapter pins are freed. Raises RequestTimeout past the deadline.
    """
    ctx = plan.ctx
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
    started: set[int] = set()
    finished: set[int] = set()

    async def pump(index: int, request: EngineRequest) -> None:
        started.add(index)
        try:
            async for out in engine.generate(request):
                queue.put_nowait((index, out))
        except ValueError as exc:  # refused by the engine's own validation: it never saw the request
            failed = failed_output(request, str(exc))
            # So the request still ends (and is metered) once: off the event loop, like every other
            # end (the engine's dispatcher thread), since the meter and the quotas may do I/O.
            await asyncio.to_thread(inflight.on_engine_finished, failed)
            queue.put_nowait((index, failed))

    plan.is_started = True
    inflight.add(ctx)
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(plan.requests)]
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while len(finished) < len(tasks):
            try:
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands as the queue hands
                # over an item (it returns the item instead), and the generation would run to its end.
                async with asyncio.timeout_at(deadline):
                    index, out = await queue.get()
            except TimeoutError:
                ctx.abort_reason = ctx.abort_reason or "timeout"
                raise RequestTimeout() from None
            if out.finished:
                finished.add(index)
            yield index, out
    finally:
        # No awaits here: this also runs inside a cancelled task (client disconnect).
        for task in tasks:
            task.cancel()
        for index, request in enumerate(plan.requests):
            if index in finished:
                continue
            if index in started:
                engine.abort(request.request_id)  # the engine's on_finished drops it from inflight
            else:
                inflight.discard(request)


async def collect(
    *, engine: AsyncEngine, inflight: InFlight, timeout_s: float, plan: GenerationPlan
) -> list[RequestOutput]:
    """Final outputs in choice order (a non-streaming response)."""
    finals: dict[int, RequestOutput] = {}
    outputs = run_choices(engine=engine, inflight=inflight, timeout_s=timeout_s, plan=plan)
    try:
        async for index, out in outputs:
            if out.finished:
                finals[index] = out
    finally:
        await outputs.aclose()
    return [finals[i] for i in range(len(plan.requests))]


def abandon_unstarted(*, inflight: InFlight, plan: GenerationPlan) -> None:
    """End an admitted request whose outputs were never asked for (the client left before its stream
    or handler started), so that it is reported finished, aborted, exactly like any other abort."""
    if plan.is_started:
        return
    plan.is_started = True
    inflight.add(plan.ctx)
    for request in plan.requests:
        inflight.discard(request)


def abort_plan(*, engine: AsyncEngine, plan: GenerationPlan) -> None:
    """Abort every engine request of the plan now (a no-op for those already finished)."""
    for request in plan.requests:
        engine.abort(request.request_id)


async def _wait_for_disconnect(request: Request) -> None:
    # Reads the ASGI channel directly (as vLLM's `with_cancellation`): the body is already consumed,
    # so the next message is http.disconnect when the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(
    request: Request, ctx: RequestContext, work: Coroutine[Any, Any, T], on_disconnect: Callable[[], None]
) -> T:
    """Run `work`; if the client disconnects first, call `on_disconnect` (it aborts the engine requests,
    whether or not the cancel reaches `work` at once) and cancel `work`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    ctx.abort_reason = ctx.abort_reason or "disconnect"
    on_disconnect()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    # Nobody reads this response; the status is for the access log (nginx's "client closed request").
    raise APIError(499, "client disconnected", code="client_disconnected")
