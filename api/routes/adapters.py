"""Adapter REST routes for tenants: upload (multipart), list, inspect, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response

from api.deps import SessionDep, StateDep, TenantDep
from api.errors import responses
from api.tenant_adapters import service as adapter_service
from registry.adapters import MAX_VERSION

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])


@router.post("", status_code=201, responses=responses(400, 401, 404, 409, 413, 429))
async def upload(request: Request, response: Response, state: StateDep, caller: TenantDep) -> dict[str, Any]:
    view, is_new = await adapter_service.upload_adapter(
        registrar=state.registrar, request=request, caller=caller
    )
    if not is_new:  # byte-identical to the latest version: that version, nothing created
        response.status_code = 200
    return view


@router.get("", responses=responses(401))
def list_adapters(state: StateDep, session: SessionDep, caller: TenantDep) -> dict[str, Any]:
    data = adapter_service.list_own_adapters(session=session, residency=state.residency, caller=caller)
    return {"object": "list", "data": data}


@router.get("/{name}", responses=responses(401, 404))
def get_adapter(name: str, state: StateDep, session: SessionDep, caller: TenantDep) -> dict[str, Any]:
    return adapter_service.get_own_adapter(
        session=session, residency=state.residency, caller=caller, name=name
    )


@router.delete("/{name}", responses=responses(400, 401, 404))
def delete_adapter(
    name: str,
    state: StateDep,
    session: SessionDep,
    caller: TenantDep,
    version: int | None = Query(None, ge=1, le=MAX_VERSION),
) -> dict[str, Any]:
    return adapter_service.delete_own_adapter(
        session=session, caller=caller, name=name, version=version, is_fleet=state.settings.fleet
    )
