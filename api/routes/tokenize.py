"""vLLM's `/tokenize` and `/detokenize` (tenant key; `model` = the base model or the caller's adapter)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import InferenceDep, SessionDep, TenantDep
from api.errors import responses
from api.inference import tokenization
from api.inference.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

router = APIRouter(tags=["tokenize"])


@router.post("/tokenize", responses=responses(400, 401, 404))
async def tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest,
    inference: InferenceDep,
    session: SessionDep,
    caller: TenantDep,
) -> dict[str, Any]:
    async with inference.plan_gate.slot(caller.tenant.id):  # as completions: api/tenancy/plan_gate.py
        return await run_in_threadpool(
            tokenization.tokenize,
            engine=inference.engine,
            model_name=inference.model_name,
            session=session,
            caller=caller,
            body=body,
        )


@router.post("/detokenize", responses=responses(400, 401, 404))
def detokenize(
    body: DetokenizeRequest, inference: InferenceDep, session: SessionDep, caller: TenantDep
) -> dict[str, Any]:
    return tokenization.detokenize(
        engine=inference.engine, model_name=inference.model_name, session=session, caller=caller, body=body
    )
