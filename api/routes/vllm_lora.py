"""vLLM's runtime adapter endpoints, for a tenant: `POST /v1/load_lora_adapter` is an import by reference
(api/tenant_adapters/imports.py: only from the prefixes the operator granted this tenant; a plain path
is read as `file://` + its absolute path) and `POST /v1/unload_lora_adapter` deletes every version of
the adapter. Both answer vLLM's plain-text success line; errors are our JSON 4xx.

Unlike vLLM, loading a name that exists is not an error: different files become its next version,
identical files keep the version it has."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from api.deps import SessionDep, StateDep, TenantDep
from api.errors import ErrorResponse, responses
from api.tenant_adapters import imports as adapter_import
from api.tenant_adapters import service as adapter_service

router = APIRouter(tags=["adapters"])
_LOAD_STATUSES = {
    **responses(400, 401, 404, 409, 413, 429, 504),
    403: {"model": ErrorResponse, "description": "The path is not under a prefix granted to this tenant"},
}


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=256)
    lora_path: str = Field(max_length=2048, description="a directory, file:///dir or s3://bucket/prefix")
    load_inplace: bool | None = None  # vLLM's; a changed adapter always becomes a new version here


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=256)
    lora_int_id: int | None = None  # vLLM's internal id: accepted, not needed


def lora_uri(path: str) -> str:
    """A URI for the import: "/data/a" -> "file:///data/a"; "s3://b/p" and "file:///d" as they are."""
    return path if "://" in path else "file://" + os.path.abspath(path)


@router.post(
    "/v1/load_lora_adapter",
    response_model=None,
    responses=_LOAD_STATUSES,
)
async def load_lora_adapter(body: LoadLoraRequest, state: StateDep, caller: TenantDep) -> PlainTextResponse:
    await adapter_import.import_adapter(
        registrar=state.registrar,
        settings=state.settings,
        caller=caller,
        name=body.lora_name,
        uri=lora_uri(body.lora_path),
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_model=None, responses=responses(400, 401, 404))
def unload_lora_adapter(
    body: UnloadLoraRequest, state: StateDep, session: SessionDep, caller: TenantDep
) -> PlainTextResponse:
    adapter_service.delete_own_adapter(
        session=session, caller=caller, name=body.lora_name, version=None, is_fleet=state.settings.fleet
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
