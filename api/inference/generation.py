"""The per-request path of the OpenAI endpoints, in order:

1. `plan_generation` (sync, in a worker thread): resolve `model` (base or the caller's adapter, never
   another tenant's), tokenize, check parameters and context length, build one engine request per
   choice (derived seeds for n > 1, the tenant's cache salt), and its provenance (api/inference/provenance.py:
   a seed drawn when none was sent, `deterministic`). Errors here are 4xx before any 200.
2. admission checks (quotas, issue 7) then `Admission.acquire` (bounded queue, 503 + Retry-After).
3. `run_choices`: submit every engine request, merge their outputs, enforce the per-request timeout,
   and abort whatever is unfinished when the consumer goes away (disconnect, timeout, error).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from sqlalchemy.orm import Session

from api.context import RequestContext, RequestKind, new_request_id
from api.deps import Caller
from api.errors import APIError, model_not_found
from api.inference.protocol import ChatCompletionRequest, CompletionRequest
from api.inference.provenance import request_provenance
from api.inference.sampling import (
    check_stream_options,
    encode_chat_prompt,
    encode_completion_prompts,
    generation_defaults,
    request_seed,
    sampling_params,
)
from api.inference.structured_outputs import request_grammar
from api.inference.tools import ToolPlan, plan_tools
from api.state import AppState
from base_engine.async_engine import EngineRequest, failed_output
from base_engine.outputs import RequestOutput
from registry.adapters import resolve_adapter
from registry.errors import NotFound
from registry.types import AdapterVersionInfo

T = TypeVar("T")


@dataclass(slots=True)
class GenerationPlan:
    ctx: RequestContext
    requests: list[EngineRequest]  # index = choice index = prompt * n + j
    stream: bool
    include_usage: bool
    num_top_logprobs: int | None  # None = no logprobs asked
    tools: ToolPlan | None = None  # chat with `tools`: how to parse the output (api/inference/tools.py)
    is_started: bool = False  # run_choices began: from then on it reports every engine request's end


class RequestTimeout(Exception):
    pass


def resolve_model(state: AppState, session: Session, caller: Caller, model: str) -> AdapterVersionInfo | None:
    """None for the base model, else the caller's own adapter version; 404 model_not_found otherwise."""
    if model == state.model_name:
        return None
    try:
        return resolve_adapter(session, tenant_id=caller.tenant.id, model=model)
    except NotFound:
        raise model_not_found(model) from None


def plan_generation(
    *,
    state: AppState,
    session: Session,
    caller: Caller,
    body: CompletionRequest | ChatCompletionRequest,
    kind: RequestKind,
) -> GenerationPlan:
    include_usage = check_stream_options(body)
    adapter = resolve_model(state, session, caller, body.model)
    engine = state.engine
    tools = None
    if isinstance(body, ChatCompletionRequest):
        tools = plan_tools(body, state.tokenizer)
        prompts = [encode_chat_prompt(state.tokenizer, body, tools, engine.max_model_len)]
    else:
        prompts = encode_completion_prompts(engine, body)
    grammar = request_grammar(engine, body, tools)  # compiled here, in this worker thread
    n = body.n or 1
    ctx = RequestContext(
        request_id=new_request_id(kind),
        kind=kind,
        tenant_id=caller.tenant.id,
        tenant_name=caller.tenant.name,
        key_prefix=caller.key_prefix,
        model=body.model,
        adapter_name=adapter.name if adapter else None,
        adapter_version=adapter.version if adapter else None,
        user=body.user,
        quotas=caller.tenant.quotas,
        num_prompts=len(prompts),
        n=n,
        num_prompt_tokens=sum(len(p) for p in prompts),
    )
    seed = request_seed(body, state.seeds)
    deterministic = state.settings.deterministic or bool(body.deterministic)
    if deterministic and (reason := engine.determinism_refusal()) is not None:
        raise APIError(400, reason, param="deterministic", code="unsupported_value")
    if state.provenance is not None:
        ctx.provenance = request_provenance(state.provenance, adapter, seed=seed, deterministic=deterministic)
    salt = state.cache_salt(caller.tenant.id)
    requests = []
    for p, prompt_ids in enumerate(prompts):
        for j in range(n):
            params = sampling_params(
                body,
                num_prompt=len(prompt_ids),
                max_model_len=state.max_model_len,
                index=j,
                defaults=generation_defaults(engine.model_dir),
                constraint=grammar.new_constraint() if grammar is not None else None,
                keep_special_tokens=tools is not None and tools.keeps_special_tokens,
                seed=seed,
                deterministic=deterministic,
            )
            request = EngineRequest(
                request_id=ctx.engine_request_id(p * n + j),
                prompt_token_ids=prompt_ids,
                params=params,
                adapter=adapter.ref if adapter else None,
                tenant_id=caller.tenant.id,
                cache_salt=salt,
            )
            try:
                state.engine.validate(request)
            except ValueError as exc:
                raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
            requests.append(request)
    ctx.engine_request_ids = [r.request_id for r in requests]
    ctx.max_new_tokens = sum(r.params.max_tokens for r in requests)
    top = requests[0].params.logprobs
    return GenerationPlan(ctx, requests, bool(body.stream), include_usage, top, tools)


async def run_choices(state: AppState, plan: GenerationPlan) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every engine request of the plan, as they come.

    Leaving early (consumer closed or cancelled, timeout) aborts the unfinished engine requests at
    once, so their KV blocks and adapter pins are freed. Raises RequestTimeout past the deadline.
    """
    engine, ctx = state.engine, plan.ctx
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
            state.inflight.on_engine_finished(failed)  # so the request still ends (and is metered) once
            queue.put_nowait((index, failed))

    plan.is_started = True
    state.inflight.add(ctx)
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(plan.requests)]
    deadline = asyncio.get_running_loop().time() + state.settings.request_timeout_s
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
                state.inflight.discard(request)


def abandon_unstarted(state: AppState, plan: GenerationPlan) -> None:
    """End an admitted request whose outputs were never asked for (the client left before its stream
    or handler started), so that it is reported finished, aborted, exactly like any other abort."""
    if plan.is_started:
        return
    plan.is_started = True
    state.inflight.add(plan.ctx)
    for request in plan.requests:
        state.inflight.discard(request)


async def collect(state: AppState, plan: GenerationPlan) -> list[RequestOutput]:
    """Final outputs in choice order (a non-streaming response)."""
    finals: dict[int, RequestOutput] = {}
    outputs = run_choices(state, plan)
    try:
        async for index, out in outputs:
            if out.finished:
                finals[index] = out
    finally:
        await outputs.aclose()
    return [finals[i] for i in range(len(plan.requests))]


async def _wait_for_disconnect(request: Request) -> None:
    # Reads the ASGI channel directly (as vLLM's `with_cancellation`): the body is already consumed,
    # so the next message is http.disconnect when the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def abort_plan(state: AppState, plan: GenerationPlan) -> None:
    """Abort every engine request of the plan now (a no-op for those already finished)."""
    for request in plan.requests:
        state.engine.abort(request.request_id)


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
