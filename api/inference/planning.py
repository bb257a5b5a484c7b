"""Planning a completion (sync, in a worker thread): resolve `model` (the base model or the caller's
own adapter, never another tenant's), tokenize, check parameters and context length, build one engine
request per choice (derived seeds for n > 1, the tenant's cache salt), and its provenance
(api/inference/provenance.py: a seed drawn when none was sent, `deterministic`). Every error here is
a 4xx before any 200; a request past the fan-out or stop bounds (api/inference/limits.py) is refused
before anything is resolved or encoded, past the logprob bound once its `max_tokens` are known. Then,
before admission, the adapter's files are fetched (`fetch_adapter`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.context import ID_PREFIX, Caller, RequestContext, RequestKind, assigned_request_id, new_request_id
from api.errors import APIError, model_not_found, request_id_in_use
from api.inference.adapter_fetch import AdapterFetch, StoreUnreachable, adapter_unavailable
from api.inference.echo import EchoPrompt, echo_prompts
from api.inference.limits import check_fan_out_and_stops, check_logprob_entries
from api.inference.logit_fields import logit_rule_options, refuse_beam_search, truncate_prompt
from api.inference.prompt_logprobs import check_prompt_logprobs
from api.inference.protocol import ChatCompletionRequest, CompletionRequest
from api.inference.provenance import request_provenance
from api.inference.sampling import (
    check_stream_options,
    completion_prompts,
    encode_chat_prompt,
    encode_completion_prompts,
    generation_defaults,
    request_seed,
    sampling_params,
)
from api.inference.services import Inference
from api.inference.structured_outputs import request_grammar
from api.inference.tool_prompt import SYSTEM_PROMPT_TOOLS, TOOLS_HEADER
from api.inference.tools import ToolPlan, plan_tools
from api.tenancy.keyfiles import tenant_cache_salt
from api.tenancy.priority import request_priority
from base_engine.async_engine import AsyncEngine, EngineRequest
from base_engine.constraints import CompiledGrammar
from registry.adapters import resolve_adapter
from registry.errors import NotFound, RegistryError
from registry.types import AdapterVersionInfo
from registry.usage import is_request_id_used

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationPlan:
    ctx: RequestContext
    requests: list[EngineRequest]  # index = choice index = prompt * n + j
    stream: bool
    include_usage: bool
    num_top_logprobs: int | None  # None = no logprobs asked
    tools: ToolPlan | None = None  # chat with `tools`: how to parse the output (api/inference/tools.py)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens read "token_id:N"
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far
    echo: list[EchoPrompt] | None = None  # per prompt, what its choices start with (api/inference/echo.py)
    num_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs asked (api/inference/prompt_logprobs.py)
    is_started: bool = False  # running began: from then on it reports every engine request's end


def resolve_model(
    *, model_name: str, session: Session, caller: Caller, model: str
) -> AdapterVersionInfo | None:
    """None for the base model, else the caller's own adapter version; 404 model_not_found otherwise."""
    if model == model_name:
        return None
    try:
        return resolve_adapter(session, tenant_id=caller.tenant.id, model=model)
    except NotFound:
        raise model_not_found(model) from None


def plan_generation(
    *,
    inference: Inference,
    session: Session,
    caller: Caller,
    body: CompletionRequest | ChatCompletionRequest,
    kind: RequestKind,
    client_id: str | None = None,
) -> GenerationPlan:
    include_usage = check_stream_options(body)
    refuse_beam_search(body)
    is_chat = isinstance(body, ChatCompletionRequest)
    num_prompts = len(completion_prompts(body)) if isinstance(body, CompletionRequest) else 1
    check_fan_out_and_stops(body, num_prompts=num_prompts, limits=inference.limits)
    engine = inference.engine
    adapter = resolve_model(model_name=inference.model_name, session=session, caller=caller, model=body.model)
    tools, echo = None, None
    if isinstance(body, ChatCompletionRequest):
        tools = plan_tools(body, engine.tokenizer, override=inference.tool_call_parser)
        encoded = [encode_chat_prompt(engine.tokenizer, body, tools, engine.max_model_len)]
    else:
        encoded = encode_completion_prompts(engine, body)
    prompts = [truncate_prompt(p, body, engine.max_model_len) for p in encoded]
    if isinstance(body, CompletionRequest):
        echo = echo_prompts(body, encoded, prompts, engine.tokenizer)
    grammar = request_grammar(engine, body, tools)  # compiled here, in this worker thread
    request_id, client_id = _request_id(session=session, caller=caller, kind=kind, client_id=client_id)
    ctx = RequestContext(
        request_id=request_id,
        client_id=client_id,
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
        n=body.n or 1,
        num_prompt_tokens=sum(len(p) for p in prompts),
        priority=request_priority(body.priority, caller.tenant),
    )
    if tools is not None and tools.in_system_prompt:  # the template cannot render tools (tool_prompt.py)
        ctx.response_headers[TOOLS_HEADER] = SYSTEM_PROMPT_TOOLS
    seed = request_seed(body, inference.seeds, ctx.engine_key)
    deterministic = inference.is_deterministic or bool(body.deterministic)
    if deterministic and (reason := engine.determinism_refusal()) is not None:
        raise APIError(400, reason, param="deterministic", code="unsupported_value")
    if inference.provenance is not None:
        ctx.provenance = request_provenance(
            inference.provenance, adapter, seed=seed, deterministic=deterministic
        )
    requests = _engine_requests(
        engine=engine,
        ctx=ctx,
        body=body,
        prompts=prompts,
        adapter=adapter,
        tools=tools,
        grammar=grammar,
        seed=seed,
        deterministic=deterministic,
        cache_salt=tenant_cache_salt(inference.server_secret, caller.tenant.id),
        # the adapter's own defaults first, then the checkpoint's (api/inference/adapter_defaults.py)
        defaults=generation_defaults(engine.model_dir)
        | inference.adapter_defaults.get(caller.tenant.id, adapter.name if adapter else None),
    )
    ctx.engine_request_ids = [r.request_id for r in requests]
    ctx.max_new_tokens = sum(r.params.max_tokens for r in requests)
    top = requests[0].params.logprobs
    check_logprob_entries(
        num_top_logprobs=top,
        total_max_tokens=ctx.max_new_tokens,
        limits=inference.limits,
        param="top_logprobs" if is_chat else "logprobs",
    )
    check_prompt_logprobs(body, num_prompt_tokens=ctx.num_prompt_tokens, limits=inference.limits)
    plan = GenerationPlan(ctx, requests, bool(body.stream), include_usage, top, tools)
    plan.tokens_as_ids = bool(body.return_tokens_as_token_ids)
    options = body.stream_options
    plan.continuous_usage = bool(include_usage and options and options.continuous_usage_stats)
    plan.echo = echo
    plan.num_prompt_logprobs = body.prompt_logprobs
    return plan


def _request_id(
    *, session: Session, caller: Caller, kind: RequestKind, client_id: str | None
) -> tuple[str, str | None]:
    """The request id and the client id it uses (None when the fleet ingress's id won, or none was
    sent); 409 when the tenant was already billed under it (in flight: admission's check). A fleet
    ingress's retry skips the billed check: a record under the id is the attempt of the replica that
    went away (its journal, replayed), and usage's ON CONFLICT (tenant, id) keeps that one record."""
    request_id = new_request_id(kind, client_id)
    if client_id is None or request_id != f"{ID_PREFIX[kind]}-{client_id}":
        return request_id, None
    assigned = assigned_request_id.get()
    is_retry = assigned is not None and assigned.is_retry
    if not is_retry and is_request_id_used(session, tenant_id=caller.tenant.id, request_id=request_id):
        raise request_id_in_use(client_id)
    return request_id, client_id


def _engine_requests(
    *,
    engine: AsyncEngine,
    ctx: RequestContext,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    adapter: AdapterVersionInfo | None,
    tools: ToolPlan | None,
    grammar: CompiledGrammar | None,
    seed: int | None,
    deterministic: bool,
    cache_salt: bytes,
    defaults: dict[str, float | int],
) -> list[EngineRequest]:
    """One engine request per choice, each validated by the engine (400 when it would refuse it)."""
    rules = logit_rule_options(body, engine.tokenizer, engine.vocab_size)
    requests = []
    for p, prompt_ids in enumerate(prompts):
        for j in range(ctx.n):
            params = sampling_params(
                body,
                num_prompt=len(prompt_ids),
                max_model_len=engine.max_model_len,
                index=j,
                defaults=defaults,
                constraint=grammar.new_constraint() if grammar is not None else None,
                keep_special_tokens=tools is not None and tools.keeps_special_tokens,
                seed=seed,
                deterministic=deterministic,
                rules=rules,
            )
            request = EngineRequest(
                request_id=ctx.engine_request_id(p * ctx.n + j),
                prompt_token_ids=prompt_ids,
                params=params,
                adapter=adapter.ref if adapter else None,
                tenant_id=ctx.tenant_id,
                cache_salt=cache_salt,
                priority=ctx.priority,
            )
            try:
                engine.validate(request)
            except ValueError as exc:
                raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
            requests.append(request)
    return requests


async def fetch_adapter(
    *, engine: AsyncEngine, adapter_fetch: AdapterFetch | None, plan: GenerationPlan
) -> None:
    """The files of an adapter the engine does not hold are fetched into the disk tier before the
    request is admitted: an unreachable object store is a 503 before any 200 (streams included), and
    no admission slot waits for a download."""
    ref = plan.requests[0].adapter if plan.requests else None
    if ref is None or adapter_fetch is None or ref.id in engine.adapter_residency():
        return
    try:
        await adapter_fetch.ensure_local(ref)
    except StoreUnreachable:
        raise adapter_unavailable(plan.ctx.model) from None
    except RegistryError as exc:  # deleted behind the registry's back, corrupt: not the caller's fault
        logger.error("adapter %s cannot be fetched: %s", ref.id, exc)
        raise APIError(
            500, f"The adapter `{plan.ctx.model}` cannot be served now.", code="adapter_load_failed"
        ) from None
