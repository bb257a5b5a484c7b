"""Adapters by reference: `POST /v1/adapters/import` (tenant) and its admin twin
(api/tenant_adapters/imports.py), and the admin's per-tenant grants
(`/admin/api/tenants/{id}/import-prefixes`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from api.admin import service as admin_service
from api.deps import AdminDep, SessionDep, StateDep, TenantDep
from api.errors import ErrorResponse, responses
from api.tenant_adapters import imports as adapter_import

router = APIRouter(tags=["adapters"])
_STATUSES = {
    **responses(400, 401, 404, 409, 413, 429, 504),
    403: {"model": ErrorResponse, "description": "The uri is not under a prefix the operator allows"},
}


class ImportPrefixes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefixes: list[Annotated[str, Field(max_length=2048)]] = Field(
        max_length=64, description="s3://bucket/prefix (or file:///dir) prefixes this tenant may import from"
    )


class ImportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=256)
    uri: str = Field(max_length=2048, description="s3://bucket/prefix holding the two PEFT files")


@router.post("/v1/adapters/import", status_code=201, responses=_STATUSES)
async def import_adapter(
    body: ImportRequest, response: Response, state: StateDep, caller: TenantDep
) -> dict[str, Any]:
    view, is_new = await adapter_import.import_adapter(
        registrar=state.registrar, settings=state.settings, caller=caller, name=body.name, uri=body.uri
    )
    if not is_new:  # byte-identical to the latest version: that version, nothing created
        response.status_code = 200
    return view


@router.post("/admin/api/tenants/{tenant_id}/adapters/import", status_code=201, responses=_STATUSES)
async def import_adapter_for_tenant(
    tenant_id: str, body: ImportRequest, response: Response, state: StateDep, _: AdminDep
) -> dict[str, Any]:
    view, is_new = await adapter_import.import_adapter_for_tenant(
        registrar=state.registrar,
        settings=state.settings,
        tenant_id=tenant_id,
        name=body.name,
        uri=body.uri,
    )
    if not is_new:
        response.status_code = 200
    return view


@router.get("/admin/api/tenants/{tenant_id}/import-prefixes", responses=responses(401, 404))
def read_import_grants(tenant_id: str, _: AdminDep, session: SessionDep) -> dict[str, Any]:
    return admin_service.tenant_import_grants(session, tenant_id=tenant_id)


@router.put("/admin/api/tenants/{tenant_id}/import-prefixes", responses=responses(400, 401, 404))
def replace_import_grants(
    tenant_id: str, body: ImportPrefixes, _: AdminDep, state: StateDep, session: SessionDep
) -> dict[str, Any]:
    return admin_service.grant_imports(
        session, settings=state.settings, tenant_id=tenant_id, prefixes=body.prefixes
    )
