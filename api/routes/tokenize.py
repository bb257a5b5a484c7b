"""vLLM's `/tokenize` and `/detokenize` (tenant key; `model` = the base model or the caller's adapter)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import SessionDep, StateDep, TenantDep
from api.errors import responses
from api.inference import tokenization
from api.inference.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

router = APIRouter(tags=["tokenize"])


@router.post("/tokenize", responses=responses(400, 401, 404))
async def tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest,
    state: StateDep,
    session: SessionDep,
    caller: TenantDep,
) -> dict[str, Any]:
    async with state.plan_gate.slot(caller.tenant.id):  # as completions: api/tenancy/plan_gate.py
        return await run_in_threadpool(
            tokenization.tokenize, state=state, session=session, caller=caller, body=body
        )


@router.post("/detokenize", responses=responses(400, 401, 404))
def detokenize(
    body: DetokenizeRequest, state: StateDep, session: SessionDep, caller: TenantDep
) -> dict[str, Any]:
    return tokenization.detokenize(state=state, session=session, caller=caller, body=body)
