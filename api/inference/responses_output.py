"""`POST /v1/responses`: the Responses body becomes its chat request (api/inference/responses_protocol.py),
which is planned, admitted, run and metered exactly as chat is (api/inference/completions.py's steps);
only the answer's shape differs: a `response` object, or its SSE events (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` / `.done`, `response.content_part.done`, `response.output_item.done`,
`response.function_call_arguments.delta` / `.done`, `response.completed`), each with `sequence_number`.

Usage is `input_tokens` / `output_tokens` / `total_tokens` (+ cached and reasoning details); it is the
chat path's one billed usage (metered once, by the engine request's end).

`previous_response_id` puts the stored conversation before the input; `store: true` keeps the
finished response (api/inference/stored_responses.py), streamed or not; a response that ended in an
error is not kept.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.context import Caller, Usage, compute_usage
from api.errors import APIError
from api.inference import provenance
from api.inference.completions import _admit, _plan, _run_to_end
from api.inference.planning import GenerationPlan
from api.inference.responses import ClosingStream, failure, timeout_error
from api.inference.responses_protocol import ResponsesRequest, chat_request, input_items
from api.inference.running import (
    RequestTimeout,
    abandon_unstarted,
    abort_plan,
    run_choices,
    unless_disconnected,
)
from api.inference.services import Inference
from api.inference.tools import message_fields


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def _response(
    body: ResponsesRequest,
    resp_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": bool(body.store),
        "temperature": body.temperature,
        "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
        "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
        "tools": tools,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "metadata": body.metadata or {},
        **extra,
    }


def _finished(
    body: ResponsesRequest, resp_id: str, created: int, plan: GenerationPlan, text: str, reason: str | None
) -> dict[str, Any]:
    content, calls = message_fields(plan.tools, text)
    output: list[dict[str, Any]] = []
    if content:
        output.append(_message_item(_id("msg"), content))
    output += [_call_item(c) for c in calls or []]
    status, details = "completed", None
    if reason == "length":
        status, details = "incomplete", {"reason": "max_output_tokens"}
    return _response(
        body, resp_id, created, status, output, incomplete_details=details, usage=_usage(plan.ctx.usage)
    )


async def create_response(
    *, inference: Inference, request: Request, session: Session, caller: Caller, body: ResponsesRequest
) -> Response:
    earlier = await _earlier(inference, caller, body)
    chat = chat_request(body, earlier)
    plan = await _plan(
        inference=inference, request=request, session=session, caller=caller, body=chat, kind="chat"
    )
    ticket = await _admit(inference=inference, plan=plan)
    ctx = plan.ctx
    headers = {"X-Request-Id": ctx.header_id, **ctx.response_headers, **provenance.headers(ctx.provenance)}
    resp_id, created = "resp_" + ctx.request_id.split("-", 1)[-1], int(time.time())
    keep = _keeper(inference, caller, body, earlier)
    if plan.stream:

        def on_close() -> None:
            abandon_unstarted(inflight=inference.inflight, plan=plan)
            ticket.release(plan.ctx.usage)

        events = _events(
            inference=inference, plan=plan, body=body, resp_id=resp_id, created=created, keep=keep
        )
        return ClosingStream(events, on_close, media_type="text/event-stream", headers=headers)
    try:
        finals = await unless_disconnected(
            request,
            ctx,
            _run_to_end(inference=inference, plan=plan),
            on_disconnect=lambda: abort_plan(engine=inference.engine, plan=plan),
        )
    except APIError as exc:
        return exc.response(headers)
    finally:
        abandon_unstarted(inflight=inference.inflight, plan=plan)
        ticket.release(ctx.usage)
    out = finals[0]
    done = _finished(body, resp_id, created, plan, out.text, out.finish_reason)
    if keep is not None:
        await keep(done)
    return JSONResponse(done, headers=headers)


async def _earlier(inference: Inference, caller: Caller, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The stored conversation `previous_response_id` continues (404 when the tenant has none such)."""
    stored = inference.stored_responses
    if stored is None and (body.store or body.previous_response_id is not None):
        field = "store" if body.store else "previous_response_id"
        raise APIError(400, f"`{field}` is not supported by this server: responses are not kept", param=field)
    if stored is None or body.previous_response_id is None:
        return []
    return await run_in_threadpool(
        stored.conversation, tenant_id=caller.tenant.id, response_id=body.previous_response_id
    )


def _keeper(
    inference: Inference, caller: Caller, body: ResponsesRequest, earlier: list[dict[str, Any]]
) -> Callable[[dict[str, Any]], Awaitable[None]] | None:
    """With `store: true`: what keeps the finished response and the conversation it answered."""
    stored = inference.stored_responses
    if not body.store or stored is None:
        return None
    items = [*earlier, *input_items(body)]

    async def keep(response: dict[str, Any]) -> None:
        await run_in_threadpool(stored.save, tenant_id=caller.tenant.id, response=response, input_items=items)

    return keep


class _Events:
    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        self.number += 1
        data = {"type": kind, "sequence_number": self.number - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(
    *,
    inference: Inference,
    plan: GenerationPlan,
    body: ResponsesRequest,
    resp_id: str,
    created: int,
    keep: Callable[[dict[str, Any]], Awaitable[None]] | None,
) -> AsyncIterator[str]:
    ev = _Events()
    start = _response(body, resp_id, created, "in_progress", [])
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    parser = plan.tools.parser() if plan.tools and plan.tools.parses else None
    msg_id, streamed, text, final = _id("msg"), "", "", None
    outputs = run_choices(
        engine=inference.engine, inflight=inference.inflight, timeout_s=inference.request_timeout_s, plan=plan
    )
    error: APIError | None = None
    try:
        async for _, out in outputs:
            text += out.new_text
            delta = out.new_text
            if parser is not None:
                delta, _ = parser.feed(out.new_text, final=out.finished)
            if delta:
                if not streamed:
                    yield ev(
                        "response.output_item.added",
                        output_index=0,
                        item=_message_item(msg_id, "", "in_progress"),
                    )
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield ev(
                        "response.content_part.added",
                        item_id=msg_id,
                        output_index=0,
                        content_index=0,
                        part=part,
                    )
                streamed += delta
                yield ev(
                    "response.output_text.delta",
                    item_id=msg_id,
                    output_index=0,
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            if out.finished:
                final = out
                error = failure(plan=plan, finals=[out], adapter_fetch=inference.adapter_fetch)
    except RequestTimeout:
        error = timeout_error(inference.request_timeout_s)
    finally:
        await outputs.aclose()
    if final is not None:
        plan.ctx.usage = compute_usage([final], n=1)
    if error is not None or final is None:
        err = (error or timeout_error(inference.request_timeout_s)).body()["error"]
        yield ev("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
        return
    done = _finished(body, resp_id, created, plan, text, final.finish_reason)
    index = 0
    for item in done["output"]:
        if item["type"] == "message":
            item["id"] = msg_id
            if streamed:
                part = item["content"][0]
                yield ev(
                    "response.output_text.done",
                    item_id=msg_id,
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
                yield ev(
                    "response.content_part.done",
                    item_id=msg_id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            else:
                yield ev("response.output_item.added", output_index=index, item={**item, "content": []})
        else:
            yield ev(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            yield ev(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            yield ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        yield ev("response.output_item.done", output_index=index, item=item)
        index += 1
    if keep is not None:
        await keep(done)  # before the last event: a client that read it finds the response stored
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    yield ev(kind, response=done)
