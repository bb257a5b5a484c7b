"""OpenAI-compatible inference routes: `/v1/completions`, `/v1/chat/completions`, `/v1/responses` (and a
stored one's GET / DELETE), `/v1/models`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from api.deps import InferenceDep, SessionDep, StateDep, TenantDep
from api.errors import APIError, model_not_found, responses
from api.inference.completions import create_completion
from api.inference.protocol import ChatCompletionRequest, CompletionRequest
from api.inference.provenance import OPENAPI_HEADERS
from api.inference.responses_output import create_response
from api.inference.responses_protocol import ResponsesRequest
from api.inference.services import Inference
from api.inference.stored_responses import StoredResponses
from api.state import AppState
from registry.adapters import list_adapters

router = APIRouter(prefix="/v1", tags=["openai"])
# 200: the answer (JSON, or an SSE stream), with its request id and provenance headers
# (api/inference/provenance.py).
_ANSWER = {200: {"description": "The completion, or its SSE stream", "headers": OPENAPI_HEADERS}}


@router.post("/completions", responses=_ANSWER | responses(400, 401, 404, 429, 504))
async def completions(
    body: CompletionRequest, request: Request, inference: InferenceDep, session: SessionDep, caller: TenantDep
) -> Response:
    return await create_completion(
        inference=inference, request=request, session=session, caller=caller, body=body, kind="completion"
    )


@router.post("/chat/completions", responses=_ANSWER | responses(400, 401, 404, 429, 504))
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    inference: InferenceDep,
    session: SessionDep,
    caller: TenantDep,
) -> Response:
    return await create_completion(
        inference=inference, request=request, session=session, caller=caller, body=body, kind="chat"
    )


@router.post("/responses", responses=_ANSWER | responses(400, 401, 404, 429, 504))
async def create_responses(
    body: ResponsesRequest, request: Request, inference: InferenceDep, session: SessionDep, caller: TenantDep
) -> Response:
    """OpenAI's Responses API over the chat path (api/inference/responses_output.py); `store: true`
    keeps it for the tenant (api/inference/stored_responses.py)."""
    return await create_response(
        inference=inference, request=request, session=session, caller=caller, body=body
    )


def _stored(inference: Inference) -> StoredResponses:
    if inference.stored_responses is None:
        raise APIError(404, "responses are not stored by this server", code="response_not_found")
    return inference.stored_responses


@router.get("/responses/{response_id}", responses=responses(401, 404))
async def get_stored_response(response_id: str, inference: InferenceDep, caller: TenantDep) -> dict[str, Any]:
    """A response this tenant created with `store: true`, as it was returned."""
    stored = _stored(inference)
    return await run_in_threadpool(stored.get, tenant_id=caller.tenant.id, response_id=response_id)


@router.delete("/responses/{response_id}", responses=responses(401, 404))
async def delete_stored_response(
    response_id: str, inference: InferenceDep, caller: TenantDep
) -> dict[str, Any]:
    stored = _stored(inference)
    return await run_in_threadpool(stored.delete, tenant_id=caller.tenant.id, response_id=response_id)


def _base_card(state: AppState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "loraserve",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
        "dtype": _dtype_name(state),  # what the weights and KV cache are served in (`--dtype auto` resolved)
    }
    if state.engine.has_unloaded_vision_tower:
        card["vision_tower"] = "not loaded: the text model alone is served, image inputs are unsupported"
    return card


def _dtype_name(state: AppState) -> str:
    return str(state.engine.dtype).removeprefix("torch.")


def model_cards(*, state: AppState, session: SessionDep, caller: TenantDep) -> list[dict[str, Any]]:
    """The base model first, then each of the caller's adapters once, by bare name."""
    cards = [_base_card(state)]
    latest: dict[str, Any] = {}
    for info in list_adapters(session, tenant_id=caller.tenant.id):
        if info.name != state.model_name:  # refused at upload now; `model` names the base model anyway
            latest[info.name] = info  # ordered by version: the last one wins
    for name, info in latest.items():
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": int(info.created_at.timestamp()),
                "owned_by": caller.tenant.name,
                "root": f"{name}@{info.version}",
                "parent": state.model_name,
                "max_model_len": state.max_model_len,
                "dtype": _dtype_name(state),
            }
        )
    return cards


@router.get("/models", responses=responses(401))
def models(state: StateDep, session: SessionDep, caller: TenantDep) -> dict[str, Any]:
    return {"object": "list", "data": model_cards(state=state, session=session, caller=caller)}


@router.get("/models/{model:path}", responses=responses(401, 404))
def model(model: str, state: StateDep, session: SessionDep, caller: TenantDep) -> dict[str, Any]:
    for card in model_cards(state=state, session=session, caller=caller):
        if card["id"] == model:
            return card
    raise model_not_found(model)
