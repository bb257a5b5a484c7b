"""Admin REST routes under `/admin/api` (admin key as Bearer; tenant keys get 401)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from api.admin import service as svc
from api.deps import AdminDep, SessionDep, StateDep
from api.errors import responses
from api.fleet import views
from api.fleet.views import fleet_view
from registry.adapters import MAX_VERSION
from registry.models import TenantStatus
from registry.types import PRIORITY_MAX, PRIORITY_MIN, QUOTA_MAX, TenantQuotas

router = APIRouter(prefix="/admin/api", tags=["admin"])
MAX_AUDIT_ID = 2**31 - 1  # the column's limit: a larger `before_id` is a 400, never a database error


class Quotas(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rpm: int | None = Field(None, ge=0, le=QUOTA_MAX["rpm"])
    tpm: int | None = Field(None, ge=0, le=QUOTA_MAX["tpm"])
    max_concurrent: int | None = Field(None, ge=0, le=QUOTA_MAX["max_concurrent"])
    max_adapters: int | None = Field(None, ge=0, le=QUOTA_MAX["max_adapters"])
    max_adapter_bytes: int | None = Field(None, ge=0, le=QUOTA_MAX["max_adapter_bytes"])

    def to_registry(self) -> TenantQuotas:
        return TenantQuotas(**self.model_dump())


class Priority(BaseModel):
    model_config = ConfigDict(extra="forbid")
    default_priority: int = Field(ge=PRIORITY_MIN, le=PRIORITY_MAX, strict=True)


VersionQuery = Annotated[int | None, Query(ge=1, le=MAX_VERSION)]


class NewTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    quotas: Quotas | None = None


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(None, max_length=64)  # the column's width


def _list(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": data}


@router.post("/tenants", status_code=201, responses=responses(400, 401, 409))
def create_tenant(body: NewTenant, _: AdminDep, session: SessionDep) -> dict[str, Any]:
    quotas = body.quotas.to_registry() if body.quotas else None
    return svc.create(session, name=body.name, quotas=quotas)


@router.get("/tenants", responses=responses(401))
def list_tenants(_: AdminDep, session: SessionDep) -> dict[str, Any]:
    return _list(svc.tenants(session))


@router.get("/tenants/{tenant_id}", responses=responses(401, 404))
def get_tenant(tenant_id: str, _: AdminDep, session: SessionDep) -> dict[str, Any]:
    return svc.tenant(session, tenant_id=tenant_id)


@router.post("/tenants/{tenant_id}/suspend", responses=responses(401, 404))
def suspend_tenant(tenant_id: str, _: AdminDep, state: StateDep, session: SessionDep) -> dict[str, Any]:
    return svc.set_status(
        session, tenant_id=tenant_id, status=TenantStatus.SUSPENDED, fleet_sync=state.fleet_sync
    )


@router.post("/tenants/{tenant_id}/activate", responses=responses(401, 404))
def activate_tenant(tenant_id: str, _: AdminDep, state: StateDep, session: SessionDep) -> dict[str, Any]:
    return svc.set_status(
        session, tenant_id=tenant_id, status=TenantStatus.ACTIVE, fleet_sync=state.fleet_sync
    )


@router.delete("/tenants/{tenant_id}", responses=responses(401, 404))
def delete_tenant(tenant_id: str, _: AdminDep, state: StateDep, session: SessionDep) -> dict[str, Any]:
    return svc.set_status(
        session, tenant_id=tenant_id, status=TenantStatus.DELETED, fleet_sync=state.fleet_sync
    )


@router.put("/tenants/{tenant_id}/quotas", responses=responses(400, 401, 404))
def set_quotas(tenant_id: str, body: Quotas, _: AdminDep, session: SessionDep) -> dict[str, Any]:
    return svc.set_quotas(session, tenant_id=tenant_id, quotas=body.to_registry())


@router.put("/tenants/{tenant_id}/priority", responses=responses(400, 401, 404))
def set_priority(tenant_id: str, body: Priority, _: AdminDep, session: SessionDep) -> dict[str, Any]:
    """The tenant's priority class: its requests' default `priority` and the most urgent they may ask."""
    return svc.set_priority(session, tenant_id=tenant_id, default_priority=body.default_priority)


@router.post("/tenants/{tenant_id}/keys", status_code=201, responses=responses(400, 401, 404, 409))
def issue_key(tenant_id: str, _: AdminDep, session: SessionDep, body: NewKey | None = None) -> dict[str, Any]:
    return svc.new_key(session, tenant_id=tenant_id, label=body.label if body else None)


@router.get("/tenants/{tenant_id}/keys", responses=responses(401, 404))
def list_keys(tenant_id: str, _: AdminDep, session: SessionDep) -> dict[str, Any]:
    return _list(svc.keys(session, tenant_id=tenant_id))


@router.delete("/tenants/{tenant_id}/keys/{prefix}", responses=responses(401, 404))
def revoke_key(tenant_id: str, prefix: str, _: AdminDep, session: SessionDep) -> dict[str, Any]:
    return svc.revoke(session, tenant_id=tenant_id, prefix=prefix)


@router.get("/adapters", responses=responses(401))
def list_adapters(
    _: AdminDep, state: StateDep, session: SessionDep, tenant_id: str | None = None
) -> dict[str, Any]:
    return _list(svc.all_adapters(session, residency=state.residency, tenant_id=tenant_id))


@router.post("/tenants/{tenant_id}/adapters/{name}/pin", responses=responses(400, 401, 404, 409))
async def pin_adapter(
    tenant_id: str, name: str, _: AdminDep, state: StateDep, session: SessionDep, version: VersionQuery = None
) -> dict[str, Any]:
    return await svc.pin(
        session,
        engine=state.engine,
        residency=state.residency,
        fleet_sync=state.fleet_sync,
        tenant_id=tenant_id,
        name=name,
        version=version,
        is_pin=True,
    )


@router.post("/tenants/{tenant_id}/adapters/{name}/unpin", responses=responses(400, 401, 404, 409))
async def unpin_adapter(
    tenant_id: str, name: str, _: AdminDep, state: StateDep, session: SessionDep, version: VersionQuery = None
) -> dict[str, Any]:
    return await svc.pin(
        session,
        engine=state.engine,
        residency=state.residency,
        fleet_sync=state.fleet_sync,
        tenant_id=tenant_id,
        name=name,
        version=version,
        is_pin=False,
    )


@router.delete("/tenants/{tenant_id}/adapters/{name}", responses=responses(400, 401, 404))
async def delete_adapter(
    tenant_id: str, name: str, _: AdminDep, state: StateDep, session: SessionDep, version: VersionQuery = None
) -> dict[str, Any]:
    """Soft-delete a tenant's adapter (all versions, or `version`): it stops serving at once and, in a
    fleet, every replica evicts it."""
    return await svc.delete_adapter_versions(
        session,
        engine=state.engine,
        fleet_sync=state.fleet_sync,
        tenant_id=tenant_id,
        name=name,
        version=version,
    )


@router.get("/fleet", responses=responses(401))
def fleet(_: AdminDep, state: StateDep, session: SessionDep) -> dict[str, Any]:
    """Replicas with state (ready, draining, lost, ...), last_seen, engine summary and residency; in
    single-process mode this process alone."""
    return fleet_view(session, replica=state.replica)


@router.get(
    "/fleet/metrics",
    response_model=None,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}, **responses(401)},
)
def fleet_metrics(_: AdminDep, state: StateDep, session: SessionDep) -> Response:
    """Every live replica's latest /metrics snapshot (a `replica` label on each series), merged: for
    deployments with one HTTP entry point, where a scrape of /metrics reaches one replica."""
    body = views.fleet_metrics(session, metrics=state.metrics, is_fleet=state.settings.fleet)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/audit", responses=responses(400, 401))
def audit(
    _: AdminDep,
    session: SessionDep,
    tenant_id: str | None = None,
    limit: int = Query(100, ge=1, le=1000),
    before_id: int | None = Query(None, ge=0, le=MAX_AUDIT_ID),
) -> dict[str, Any]:
    return _list(svc.audit(session, tenant_id=tenant_id, limit=limit, before_id=before_id))


@router.get("/engine", responses=responses(401))
def engine(_: AdminDep, state: StateDep) -> dict[str, Any]:
    """Live engine statistics (KV blocks in use, queue depths, prefix-cache counters, adapter cache)."""
    return svc.engine_stats(engine=state.engine, admission=state.admission)
