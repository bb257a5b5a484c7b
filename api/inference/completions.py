"""The service behind `/v1/completions` and `/v1/chat/completions`, one step after the other:

1. plan (api/inference/planning.py): the tenant's quota precheck (429 before anything is tokenized),
   then, under the tenant's plan gate and in a worker thread, model resolution, tokenization,
   validation and the engine requests; then the adapter's files are fetched (503 when the store is
   unreachable). Every error so far comes before any 200, with the request's `X-Request-Id`.
2. admit (api/tenancy/admission.py): quotas (429), the server's in-flight bound (503), metering begins.
3. run (api/inference/running.py): the engine requests, timeout, aborts on disconnect.
4. respond (api/inference/responses.py): the JSON body or the SSE stream. Every answer, streamed or
   not, carries `X-Loraserve-Provenance` (api/inference/provenance.py), known at plan time.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.context import Caller, RequestKind, compute_usage, new_request_id
from api.errors import APIError
from api.inference import provenance
from api.inference.client_id import client_request_id
from api.inference.planning import GenerationPlan, fetch_adapter, plan_generation
from api.inference.protocol import ChatCompletionRequest, CompletionRequest
from api.inference.responses import (
    ClosingStream,
    failure,
    response_body,
    stream_events,
    timeout_error,
)
from api.inference.running import (
    RequestTimeout,
    abandon_unstarted,
    abort_plan,
    collect,
    run_choices,
    unless_disconnected,
)
from api.inference.services import Inference
from api.tenancy.admission import Ticket, admit
from base_engine.outputs import RequestOutput


async def create_completion(
    *,
    inference: Inference,
    request: Request,
    session: Session,
    caller: Caller,
    body: CompletionRequest | ChatCompletionRequest,
    kind: RequestKind,
) -> Response:
    plan = await _plan(
        inference=inference, request=request, session=session, caller=caller, body=body, kind=kind
    )
    ticket = await _admit(inference=inference, plan=plan)
    ctx = plan.ctx
    headers = {"X-Request-Id": ctx.header_id, **ctx.response_headers, **provenance.headers(ctx.provenance)}
    if plan.stream:
        return _stream(inference=inference, plan=plan, ticket=ticket, headers=headers)
    return await _answer(inference=inference, request=request, plan=plan, ticket=ticket, headers=headers)


async def _plan(
    *,
    inference: Inference,
    request: Request,
    session: Session,
    caller: Caller,
    body: CompletionRequest | ChatCompletionRequest,
    kind: RequestKind,
) -> GenerationPlan:
    try:
        client_id = client_request_id(request)  # 400 when malformed (api/inference/client_id.py)
        inference.quotas.precheck(caller.tenant.id, caller.tenant.quotas)  # nothing tokenized for a 429
    except APIError as exc:
        exc.headers = {"X-Request-Id": new_request_id(kind), **exc.headers}
        raise
    async with inference.plan_gate.slot(caller.tenant.id):  # one tenant cannot fill the worker threads
        return await run_in_threadpool(
            plan_generation,
            inference=inference,
            session=session,
            caller=caller,
            body=body,
            kind=kind,
            client_id=client_id,
        )


async def _admit(*, inference: Inference, plan: GenerationPlan) -> Ticket:
    """The adapter's files, then admission; an error here still names the request and its limits."""
    ctx = plan.ctx
    num_requests = len(plan.requests)
    try:
        await fetch_adapter(engine=inference.engine, adapter_fetch=inference.adapter_fetch, plan=plan)
        collaborators = {
            "quotas": inference.quotas,
            "admission": inference.admission,
            "meter": inference.meter,
        }
        if inference.is_quota_blocking:  # the fleet's quotas are a database transaction: off the event loop
            return await run_in_threadpool(admit, **collaborators, ctx=ctx, num_requests=num_requests)
        return admit(**collaborators, ctx=ctx, num_requests=num_requests)
    except APIError as exc:
        exc.headers = {"X-Request-Id": ctx.header_id, **ctx.response_headers, **exc.headers}
        raise


async def _run_to_end(*, inference: Inference, plan: GenerationPlan) -> list[RequestOutput]:
    """A non-streaming request's final outputs, or the error it ends with (timeout, engine, abort)."""
    try:
        finals = await collect(
            engine=inference.engine,
            inflight=inference.inflight,
            timeout_s=inference.request_timeout_s,
            plan=plan,
        )
    except RequestTimeout:
        raise timeout_error(inference.request_timeout_s) from None
    plan.ctx.usage = compute_usage(finals, n=plan.ctx.n)
    error = failure(plan=plan, finals=finals, adapter_fetch=inference.adapter_fetch)
    if error is not None:
        raise error
    return finals


async def _answer(
    *, inference: Inference, request: Request, plan: GenerationPlan, ticket: Ticket, headers: dict[str, str]
) -> Response:
    """The JSON answer: run to the end (a disconnect aborts it), then release the ticket with the usage."""
    try:
        finals = await unless_disconnected(
            request,
            plan.ctx,
            _run_to_end(inference=inference, plan=plan),
            on_disconnect=lambda: abort_plan(engine=inference.engine, plan=plan),
        )
    except APIError as exc:
        return exc.response(headers)
    finally:
        abandon_unstarted(inflight=inference.inflight, plan=plan)
        ticket.release(plan.ctx.usage)
    body = response_body(tokenizer=inference.engine.tokenizer, plan=plan, finals=finals)
    return JSONResponse(body, headers=headers)


def _stream(
    *, inference: Inference, plan: GenerationPlan, ticket: Ticket, headers: dict[str, str]
) -> Response:
    """The SSE answer; closing it (however it ends, even unread) ends the request and its ticket."""

    def on_close() -> None:
        abandon_unstarted(inflight=inference.inflight, plan=plan)
        ticket.release(plan.ctx.usage)

    outputs = run_choices(
        engine=inference.engine, inflight=inference.inflight, timeout_s=inference.request_timeout_s, plan=plan
    )
    events = stream_events(
        tokenizer=inference.engine.tokenizer,
        meter=inference.meter,
        adapter_fetch=inference.adapter_fetch,
        timeout_s=inference.request_timeout_s,
        plan=plan,
        outputs=outputs,
    )
    return ClosingStream(events, on_close, media_type="text/event-stream", headers=headers)
