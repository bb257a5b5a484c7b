"""The HTTP answer of a completion: the JSON body, or the SSE stream, and the error a request ends with.

Streaming follows the OpenAI wire format: `data: {chunk}` events, on include_usage a final chunk
with `choices: []` and the usage, then `data: [DONE]`. Once the 200 is out, a failure becomes
`data: {"error": {...}}` followed by `[DONE]` (what the openai client raises on); when every choice
has ended (a shutdown's drain aborts them all; an engine error), an include_usage stream still gets
its usage chunk first, so clients see what they are billed. Usage comes from the engine's final
outputs through `api.context.compute_usage`, the rule metering also uses. As a stream hands tokens
to its client it tells the meter (`Meter.progress`: the crash bound, api/metering/meter.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from adapters.types import AdapterRef
from api.context import RequestContext, Usage, compute_usage
from api.errors import APIError
from api.inference import formatting as fmt
from api.inference.adapter_fetch import AdapterFetch, adapter_unavailable
from api.inference.echo import echo_logprobs
from api.inference.planning import GenerationPlan
from api.inference.prompt_logprobs import vllm_prompt_logprobs
from api.inference.running import RequestTimeout
from api.inference.tools import finish_reason as tool_finish_reason
from api.inference.tools import message_fields as tool_fields
from api.metering.request_meter import Meter
from base_engine.outputs import NON_FINITE, RequestOutput

logger = logging.getLogger(__name__)


class ClosingStream(StreamingResponse):
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


def timeout_error(timeout_s: float) -> APIError:
    return APIError(504, f"request timed out after {timeout_s:g} s", code="request_timeout")


def failure(
    *, plan: GenerationPlan, finals: list[RequestOutput], adapter_fetch: AdapterFetch | None
) -> APIError | None:
    """The error a request ends with, if any. An engine error's own text is logged, never sent: it
    can name server paths, the object store and internal ids (api/errors.py)."""
    ctx = plan.ctx
    failed = [o for o in finals if o.finish_reason == "error"]
    if failed:
        logger.error("request %s failed in the engine: %s", failed[0].request_id, failed[0].error)
        if _is_adapter_unreachable(plan, failed[0], adapter_fetch):
            return adapter_unavailable(ctx.model)
        if failed[0].error_kind == NON_FINITE and _adapter_of(plan, failed[0]) is not None:
            return non_finite_activations(ctx.model)
        message = "Generation failed; the server logged the cause under this X-Request-Id."
        return APIError(500, message, code="engine_error")
    if any(o.finish_reason == "abort" for o in finals):
        if ctx.abort_reason == "shutdown":
            return APIError(
                503, "The server is shutting down; the request was aborted.", code="shutting_down"
            )
        return APIError(500, f"request aborted ({ctx.abort_reason or 'by the engine'})", code="aborted")
    return None


def non_finite_activations(model: str) -> APIError:
    """The tenant's adapter made this request's activations overflow (NaN/Inf): a fault of the adapter's
    weights on this input, not of the server, so a 4xx that says so (other requests are unaffected)."""
    return APIError(
        400,
        f"The adapter `{model}` produced non-finite activations (NaN/Inf) for this request: its weights "
        "overflow the serving dtype on this input, so the output would be meaningless. Retrain or rescale "
        "the adapter (smaller lora_alpha or weights).",
        code="non_finite_activations",
        param="model",
    )


def _adapter_of(plan: GenerationPlan, out: RequestOutput) -> AdapterRef | None:
    return next((r.adapter for r in plan.requests if r.request_id == out.request_id), None)


def _is_adapter_unreachable(
    plan: GenerationPlan, failed: RequestOutput, adapter_fetch: AdapterFetch | None
) -> bool:
    """The request failed before its first token because its adapter could not be fetched now."""
    ref = _adapter_of(plan, failed)
    return (
        ref is not None
        and failed.num_completion_tokens == 0
        and adapter_fetch is not None
        and adapter_fetch.is_unreachable(ref.id)
    )


def response_body(*, tokenizer: Any, plan: GenerationPlan, finals: list[RequestOutput]) -> dict[str, Any]:
    """The JSON answer of a non-streaming request from its final outputs in choice order."""
    ctx = plan.ctx
    logprobs = fmt.LogprobFormatter(tokenizer, plan.num_top_logprobs or 0, as_token_ids=plan.tokens_as_ids)
    choices = []
    for index, out in enumerate(finals):
        if ctx.kind != "chat":
            choices.append(_completion_choice(plan, logprobs, index, out))
            continue
        lp = None
        if plan.num_top_logprobs is not None and out.logprobs is not None:
            lp = logprobs.chat(out.token_ids, out.logprobs)
        content, calls = tool_fields(plan.tools, out.text)
        reason = tool_finish_reason(plan.tools, out.finish_reason, len(calls or ()))
        choices.append(fmt.chat_choice(index, content, reason, lp, calls, out.stop_reason))
    body = fmt.response_body(ctx, choices, compute_usage(finals, n=ctx.n))
    if ctx.kind == "chat" and plan.num_prompt_logprobs is not None:  # one prompt: beside the choices
        body["prompt_logprobs"] = _prompt_logprobs(plan, logprobs, finals[0])
    return body


def _completion_choice(
    plan: GenerationPlan, logprobs: fmt.LogprobFormatter, index: int, out: RequestOutput
) -> dict[str, Any]:
    """A completion choice: with `echo` its prompt first (text and logprobs), with `prompt_logprobs`
    vLLM's per-choice list."""
    echo = plan.echo[index // plan.ctx.n] if plan.echo else None
    lp = None
    if plan.num_top_logprobs is not None and out.logprobs is not None:
        lp = logprobs.completion(out.token_ids, out.logprobs, len(echo.text) if echo else 0)
        if echo is not None:
            lp = echo_logprobs(logprobs, echo, out.prompt_token_ids, out.prompt_logprobs or [], lp)
    text = echo.text + out.text if echo else out.text
    choice = fmt.completion_choice(index, text, out.finish_reason, lp, out.stop_reason)
    if plan.num_prompt_logprobs is not None:
        choice["prompt_logprobs"] = _prompt_logprobs(plan, logprobs, out)
    return choice


def _prompt_logprobs(
    plan: GenerationPlan, logprobs: fmt.LogprobFormatter, out: RequestOutput
) -> list[dict[str, dict[str, Any]] | None]:
    assert plan.num_prompt_logprobs is not None and out.prompt_logprobs is not None
    return vllm_prompt_logprobs(logprobs, out.prompt_logprobs, plan.num_prompt_logprobs)


def _sent_usage(ctx: RequestContext, sent: list[int], cached: dict[int, int]) -> Usage:
    """What the stream has handed its client so far (prompt counted once, its cached tokens from each
    prompt's first choice, as `compute_usage` counts them)."""
    return Usage(
        prompt_tokens=ctx.num_prompt_tokens,
        completion_tokens=sum(sent),
        cached_tokens=sum(cached.get(i, 0) for i in range(0, len(sent), ctx.n)),
    )


def _new_logprobs(
    plan: GenerationPlan, logprobs: fmt.LogprobFormatter, out: RequestOutput, text_offset: int
) -> dict[str, Any] | None:
    """The logprobs of the tokens an output streams, when asked."""
    if plan.num_top_logprobs is None or not out.new_logprobs:
        return None
    if plan.ctx.kind == "chat":
        return logprobs.chat(out.new_token_ids, out.new_logprobs)
    return logprobs.completion(out.new_token_ids, out.new_logprobs, text_offset)


def _echoed(
    plan: GenerationPlan,
    logprobs: fmt.LogprobFormatter,
    index: int,
    out: RequestOutput,
    text: str,
    lp: dict[str, Any] | None,
) -> tuple[str, dict[str, Any] | None]:
    """A choice's first chunk with `echo`: its prompt first, in the text and (asked) the logprobs."""
    assert plan.echo is not None
    echo = plan.echo[index // plan.ctx.n]
    if plan.num_top_logprobs is not None:
        lp = echo_logprobs(logprobs, echo, out.prompt_token_ids, out.prompt_logprobs or [], lp)
    return echo.text + text, lp


async def stream_events(
    *,
    tokenizer: Any,
    meter: Meter,
    adapter_fetch: AdapterFetch | None,
    timeout_s: float,
    plan: GenerationPlan,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncIterator[str]:
    """The SSE events of a streaming request from `outputs` (the running plan's (choice, output) pairs)."""
    ctx = plan.ctx
    logprobs = fmt.LogprobFormatter(tokenizer, plan.num_top_logprobs or 0, as_token_ids=plan.tokens_as_ids)
    # text offsets of each choice's next token: with echo, generated text follows the prompt's
    offsets = [len(plan.echo[i // ctx.n].text) if plan.echo else 0 for i in range(len(plan.requests))]
    finals: dict[int, RequestOutput] = {}
    parsers = [plan.tools.parser() for _ in plan.requests] if plan.tools and plan.tools.parses else None
    error: APIError | None = None
    sent = [0] * len(plan.requests)  # completion tokens handed to the client, per choice
    cached: dict[int, int] = {}
    echoed: set[int] = set()  # choices whose prompt was streamed (echo)

    def chunk(choice: dict[str, Any]) -> str:
        usage = _sent_usage(ctx, sent, cached) if plan.continuous_usage else None
        return fmt.sse(fmt.chunk_body(ctx, [choice], include_usage=plan.include_usage, usage=usage))

    if ctx.kind == "chat":
        for index in range(len(plan.requests)):
            yield chunk(fmt.chunk_choice(ctx, index, "", None, None, role=True))
    try:
        async for index, out in outputs:
            if out.finished:
                finals[index] = out
                error = error or failure(plan=plan, finals=[out], adapter_fetch=adapter_fetch)
            if error is not None:
                if ctx.abort_reason == "shutdown":
                    continue  # the drain aborts every choice: their ends make the usage chunk exact
                break
            lp = _new_logprobs(plan, logprobs, out, offsets[index])
            offsets[index] += len(out.new_text)
            text, reason, calls = out.new_text, out.finish_reason, None
            if parsers is not None:  # tool calls: content and whole calls as they complete
                parser = parsers[index]
                text, calls = parser.feed(out.new_text, final=out.finished)
                reason = tool_finish_reason(plan.tools, reason, parser.num_calls)
            if plan.echo and index not in echoed:  # the prompt leads the choice's first chunk
                text, lp = _echoed(plan, logprobs, index, out, text, lp)
                echoed.add(index)
            sent[index] += len(out.new_token_ids)  # counted in this chunk's usage (continuous_usage)
            cached[index] = out.num_cached_tokens
            if text or calls or out.finished or lp is not None:
                yield chunk(
                    fmt.chunk_choice(
                        ctx, index, text, reason, lp, tool_calls=calls, stop_reason=out.stop_reason
                    )
                )
            meter.progress(ctx, _sent_usage(ctx, sent, cached))  # after the yield: the client has them
    except RequestTimeout:
        error = error or timeout_error(timeout_s)
    finally:
        await outputs.aclose()
    if len(finals) == len(plan.requests):  # every choice ended: this usage is the billed one
        ctx.usage = compute_usage([finals[i] for i in range(len(plan.requests))], n=ctx.n)
        if plan.include_usage:  # also when cut (shutdown, engine error): before the error event
            yield fmt.sse(fmt.usage_chunk(ctx, ctx.usage))
    if error is not None:
        yield fmt.sse(error.body())
    yield fmt.sse("[DONE]")
