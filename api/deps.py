"""FastAPI dependencies as `Annotated` aliases: `StateDep`, `InferenceDep`, `SessionDep`, `TenantDep`,
`AdminDep`.

Tenant keys (`lsk-...`) authenticate only on `/v1`, the admin key (`lsa-...`) only on `/admin`: a key
of the wrong kind is 401 on both sides, so neither can stand in for the other.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.context import Caller
from api.errors import APIError
from api.inference.services import Inference
from api.state import AppState
from registry.errors import AuthError
from registry.keys import authenticate, key_prefix


async def get_state(request: Request) -> AppState:
    # async: resolved on the event loop, not in anyio's worker pool (a sync dependency would be).
    return request.app.state.loraserve


StateDep = Annotated[AppState, Depends(get_state)]


async def get_inference(state: StateDep) -> Inference:
    return state.inference


InferenceDep = Annotated[Inference, Depends(get_inference)]  # the completion / tokenize collaborators


def get_session(state: StateDep) -> Iterator[Session]:
    with state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token.strip()


def _invalid_key(cause: str) -> APIError:
    return APIError(
        401,
        f"Incorrect API key provided: {cause}",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def get_caller(request: Request, session: SessionDep) -> Caller:
    token = bearer_token(request)
    try:
        tenant = authenticate(session, api_key=token)
        return Caller(tenant=tenant, key_prefix=key_prefix(token))
    except AuthError as exc:
        raise _invalid_key(str(exc)) from None


async def precheck_caller(request: Request) -> None:
    """`get_caller`'s refusals that need no body, before it is read (api/http/key_guard.py): a missing,
    malformed or never-issued key (api/tenancy/key_precheck.py); the route then authenticates fully."""
    token = bearer_token(request)
    state: AppState = request.app.state.loraserve
    cause = await state.key_precheck.refusal(token)
    if cause is not None:
        raise _invalid_key(cause)


TenantDep = Annotated[Caller, Depends(get_caller)]


def require_admin(request: Request, state: StateDep) -> str:
    token = bearer_token(request)
    if not hmac.compare_digest(token.encode(), state.admin_key.encode()):
        raise APIError(
            401,
            "Incorrect admin key provided (tenant API keys are not accepted here).",
            code="invalid_admin_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return "admin"


AdminDep = Annotated[str, Depends(require_admin)]


async def precheck_admin(request: Request) -> None:
    """`require_admin` before the body is read (a constant-time comparison: nothing to wait for)."""
    require_admin(request, request.app.state.loraserve)
