"""The service function behind `/v1/completions` and `/v1/chat/completions`: plan -> admit -> respond.

Streaming follows the OpenAI wire format: `data: {chunk}` events, on include_usage a final chunk
with `choices: []` and the usage, then `data: [DONE]`. Once the 200 is out, a failure becomes
`data: {"error": {...}}` followed by `[DONE]` (what the openai client raises on); when every choice
has ended (a shutdown's drain aborts them all; an engine error), an include_usage stream still gets
its usage chunk first, so clients see what they are billed. Usage comes from the engine's final
outputs through `api.context.compute_usage`, the rule metering also uses. As a stream hands tokens
to its client it reports them to `on_progress` (the meter's crash bound, api/metering/meter.py). Every
answer, streamed or not, carries `X-Loraserve-Provenance` (api/inference/provenance.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from api.context import RequestContext, RequestKind, Usage, compute_usage, new_request_id
from api.deps import Caller
from api.errors import APIError
from api.inference import formatting as fmt
from api.inference import provenance
from api.inference.adapter_fetch import RETRY_AFTER_S as ADAPTER_RETRY_AFTER_S
from api.inference.adapter_fetch import StoreUnreachable
from api.inference.generation import (
    GenerationPlan,
    RequestTimeout,
    abandon_unstarted,
    abort_plan,
    collect,
    plan_generation,
    run_choices,
    unless_disconnected,
)
from api.inference.protocol import ChatCompletionRequest, CompletionRequest
from api.inference.tools import finish_reason as tool_finish_reason
from api.inference.tools import message_fields as tool_fields
from api.state import AppState
from api.tenancy.admission import NOT_ADMITTED, Ticket
from base_engine.outputs import RequestOutput
from registry.errors import RegistryError

logger = logging.getLogger(__name__)


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends, even if never iterated."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A disconnect can leave the generator suspended at a `yield`: close it now (its cleanup
            # aborts the engine requests; it never really awaits), not whenever it is collected.
            try:
                await self.body_iterator.aclose()  # type: ignore[union-attr]
            finally:
                self._on_close()


async def create_completion(
    *,
    state: AppState,
    request: Request,
    session: Session,
    caller: Caller,
    body: CompletionRequest | ChatCompletionRequest,
    kind: RequestKind,
) -> Response:
    try:
        for check in state.plan_checks:  # e.g. a tenant already over its limits: nothing tokenized
            check(caller.tenant.id, caller.tenant.quotas)
    except APIError as exc:
        exc.headers = {"X-Request-Id": new_request_id(kind), **exc.headers}
        raise
    async with state.plan_gate.slot(caller.tenant.id):  # one tenant cannot fill the worker threads
        plan = await run_in_threadpool(
            plan_generation, state=state, session=session, caller=caller, body=body, kind=kind
        )
    ctx = plan.ctx
    try:
        await _fetch_adapter(state, plan)
        if state.settings.fleet:  # the fleet's quotas are a database transaction: off the event loop
            ticket = await run_in_threadpool(admit, state, ctx, len(plan.requests))
        else:
            ticket = admit(state, ctx, len(plan.requests))
    except APIError as exc:
        exc.headers = {"X-Request-Id": ctx.request_id, **ctx.response_headers, **exc.headers}
        raise
    # Provenance is known at plan time: a stream sends it with its headers, before the first event.
    headers = {"X-Request-Id": ctx.request_id, **ctx.response_headers, **provenance.headers(ctx.provenance)}
    if plan.stream:

        def on_close() -> None:
            abandon_unstarted(state, plan)
            ticket.release(ctx.usage)

        return _ClosingStream(
            stream_events(state, plan), on_close, media_type="text/event-stream", headers=headers
        )
    try:
        finals = await unless_disconnected(
            request, ctx, _collect(state, plan), on_disconnect=lambda: abort_plan(state, plan)
        )
    except APIError as exc:
        return exc.response(headers)
    finally:
        abandon_unstarted(state, plan)
        ticket.release(ctx.usage)
    return JSONResponse(_response_body(state, plan, finals), headers=headers)


async def _fetch_adapter(state: AppState, plan: GenerationPlan) -> None:
    """The files of an adapter the engine does not hold are fetched into the disk tier before the
    request is admitted: an unreachable object store is a 503 before any 200 (streams included), and
    no admission slot waits for a download."""
    ref = plan.requests[0].adapter if plan.requests else None
    if ref is None or state.adapter_fetch is None or ref.id in state.engine.adapter_residency():
        return
    try:
        await state.adapter_fetch.ensure_local(ref)
    except StoreUnreachable:
        raise _adapter_unavailable(plan.ctx.model) from None
    except RegistryError as exc:  # deleted behind the registry's back, corrupt: not the caller's fault
        logger.error("adapter %s cannot be fetched: %s", ref.id, exc)
        raise APIError(
            500, f"The adapter `{plan.ctx.model}` cannot be served now.", code="adapter_load_failed"
        ) from None


def _adapter_unavailable(model: str) -> APIError:
    return APIError(
        503,
        f"The adapter `{model}` cannot be loaded right now (its storage is unreachable); retry later.",
        code="adapter_unavailable",
        headers={"Retry-After": str(ADAPTER_RETRY_AFTER_S)},
    )


def admit(state: AppState, ctx: RequestContext, num_requests: int) -> Ticket:
    """Quota checks (429), then the server's own bound (503); then `on_admitted` hooks (metering)."""
    releases = []
    try:
        for check in state.admission_checks:
            release = check(ctx)
            if release is not None:
                releases.append(release)
        ticket = state.admission.acquire(num_requests, ctx.tenant_id)
    except BaseException:
        for release in releases:
            release(NOT_ADMITTED)
        raise
    ticket.on_release.extend(releases)
    for hook in state.on_admitted:
        hook(ctx)
    return ticket


async def _collect(state: AppState, plan: GenerationPlan) -> list[RequestOutput]:
    try:
        finals = await collect(state, plan)
    except RequestTimeout:
        raise _timeout_error(state) from None
    plan.ctx.usage = compute_usage(finals, n=plan.ctx.n)
    failure = _failure(state, plan, finals)
    if failure is not None:
        raise failure
    return finals


def _timeout_error(state: AppState) -> APIError:
    return APIError(
        504, f"request timed out after {state.settings.request_timeout_s:g} s", code="request_timeout"
    )


def _failure(state: AppState, plan: GenerationPlan, finals: list[RequestOutput]) -> APIError | None:
    """The error a request ends with, if any. An engine error's own text is logged, never sent: it
    can name server paths, the object store and internal ids (api/errors.py)."""
    ctx = plan.ctx
    failed = [o for o in finals if o.finish_reason == "error"]
    if failed:
        logger.error("request %s failed in the engine: %s", failed[0].request_id, failed[0].error)
        if _is_adapter_unreachable(state, plan, failed[0]):
            return _adapter_unavailable(ctx.model)
        message = "Generation failed; the server logged the cause under this X-Request-Id."
        return APIError(500, message, code="engine_error")
    if any(o.finish_reason == "abort" for o in finals):
        if ctx.abort_reason == "shutdown":
            return APIError(
                503, "The server is shutting down; the request was aborted.", code="shutting_down"
            )
        return APIError(500, f"request aborted ({ctx.abort_reason or 'by the engine'})", code="aborted")
    return None


def _is_adapter_unreachable(state: AppState, plan: GenerationPlan, failed: RequestOutput) -> bool:
    """The request failed before its first token because its adapter could not be fetched now."""
    ref = next((r.adapter for r in plan.requests if r.request_id == failed.request_id), None)
    return (
        ref is not None
        and failed.num_completion_tokens == 0
        and state.adapter_fetch is not None
        and state.adapter_fetch.is_unreachable(ref.id)
    )


def _note_progress(state: AppState, ctx: RequestContext, sent: list[int], cached: dict[int, int]) -> None:
    """`on_progress` hooks with what the stream has handed its client so far (prompt counted once, its
    cached tokens from each prompt's first choice, as `compute_usage` counts them)."""
    usage = Usage(
        prompt_tokens=ctx.num_prompt_tokens,
        completion_tokens=sum(sent),
        cached_tokens=sum(cached.get(i, 0) for i in range(0, len(sent), ctx.n)),
    )
    for hook in state.on_progress:
        hook(ctx, usage)


def _response_body(state: AppState, plan: GenerationPlan, finals: list[RequestOutput]) -> dict[str, Any]:
    ctx = plan.ctx
    logprobs = fmt.LogprobFormatter(state.tokenizer, plan.num_top_logprobs or 0)
    choices = []
    for index, out in enumerate(finals):
        lp = None
        if plan.num_top_logprobs is not None and out.logprobs is not None:
            if ctx.kind == "chat":
                lp = logprobs.chat(out.token_ids, out.logprobs)
            else:
                lp = logprobs.completion(out.token_ids, out.logprobs)
        if ctx.kind == "chat":
            content, calls = tool_fields(plan.tools, out.text)
            reason = tool_finish_reason(plan.tools, out.finish_reason, len(calls or ()))
            choices.append(fmt.chat_choice(index, content, reason, lp, calls))
        else:
            choices.append(fmt.completion_choice(index, out.text, out.finish_reason, lp))
    return fmt.response_body(ctx, choices, compute_usage(finals, n=ctx.n))


async def stream_events(state: AppState, plan: GenerationPlan) -> AsyncIterator[str]:
    ctx = plan.ctx
    logprobs = fmt.LogprobFormatter(state.tokenizer, plan.num_top_logprobs or 0)
    offsets = [0] * len(plan.requests)
    finals: dict[int, RequestOutput] = {}
    parsers = [plan.tools.parser() for _ in plan.requests] if plan.tools and plan.tools.parses else None
    if ctx.kind == "chat":
        for index in range(len(plan.requests)):
            choice = fmt.chunk_choice(ctx, index, "", None, None, role=True)
            yield fmt.sse(fmt.chunk_body(ctx, [choice], include_usage=plan.include_usage))
    outputs = run_choices(state, plan)
    failure: APIError | None = None
    sent = [0] * len(plan.requests)  # completion tokens handed to the client, per choice
    cached: dict[int, int] = {}
    try:
        async for index, out in outputs:
            if out.finished:
                finals[index] = out
                failure = failure or _failure(state, plan, [out])
            if failure is not None:
                if ctx.abort_reason == "shutdown":
                    continue  # the drain aborts every choice: their ends make the usage chunk exact
                break
            lp = None
            if plan.num_top_logprobs is not None and out.new_logprobs:
                if ctx.kind == "chat":
                    lp = logprobs.chat(out.new_token_ids, out.new_logprobs)
                else:
                    lp = logprobs.completion(out.new_token_ids, out.new_logprobs, offsets[index])
            offsets[index] += len(out.new_text)
            text, reason, calls = out.new_text, out.finish_reason, None
            if parsers is not None:  # tool calls: content and whole calls as they complete
                parser = parsers[index]
                text, calls = parser.feed(out.new_text, final=out.finished)
                reason = tool_finish_reason(plan.tools, reason, parser.num_calls)
            if text or calls or out.finished or lp is not None:
                choice = fmt.chunk_choice(ctx, index, text, reason, lp, tool_calls=calls)
                yield fmt.sse(fmt.chunk_body(ctx, [choice], include_usage=plan.include_usage))
            sent[index] += len(out.new_token_ids)
            cached[index] = out.num_cached_tokens
            _note_progress(state, ctx, sent, cached)  # after the yield: the client has been sent them
    except RequestTimeout:
        failure = failure or _timeout_error(state)
    finally:
        await outputs.aclose()
    if len(finals) == len(plan.requests):  # every choice ended: this usage is the billed one
        ctx.usage = compute_usage([finals[i] for i in range(len(plan.requests))], n=ctx.n)
        if plan.include_usage:  # also when cut (shutdown, engine error): before the error event
            yield fmt.sse(fmt.usage_chunk(ctx, ctx.usage))
    if failure is not None:
        yield fmt.sse(failure.body())
    yield fmt.sse("[DONE]")
