"""Admin service functions: tenants, keys, import grants, every tenant's adapters, GPU-cache pins, audit,
engine stats.

Each management action is recorded in the audit log with actor "admin". Suspending or deleting a
tenant takes effect at once: keys and adapters are checked against the tenant's status on every
request (registry), so nothing is cached here.

In a fleet, actions that touch residency (pin, unpin, adapter delete, tenant status) go through
`registry.fleet`, which records the change and its fleet event in one transaction; every replica's
agent (api/fleet/agent.py) applies it, this one at once (`FleetSync.wake`, api/fleet/sync.py).
Each function takes the collaborators it uses, keyword-only: the engine facade, residency, fleet
sync, admission.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.errors import APIError, from_registry_error
from api.fleet.sync import FleetSync
from api.settings import Settings
from api.tenancy.admission import Admission
from api.tenant_adapters.import_sources import check_grant
from api.tenant_adapters.views import Residency, adapter_views
from base_engine.async_engine import AsyncEngine
from registry import fleet
from registry.adapters import delete_adapter, list_adapters, resolve_adapter
from registry.audit import list_audit, record_audit
from registry.errors import RegistryError
from registry.import_grants import get_import_prefixes, set_import_prefixes
from registry.keys import issue_key, list_keys, revoke_key
from registry.models import TenantStatus
from registry.tenants import (
    create_tenant,
    get_tenant,
    list_tenants,
    set_tenant_priority,
    set_tenant_quotas,
    set_tenant_status,
)
from registry.types import AuditInfo, KeyInfo, TenantInfo, TenantQuotas

ADMIN = "admin"


def _ts(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None


def tenant_view(info: TenantInfo) -> dict[str, Any]:
    return {
        "object": "tenant",
        "id": info.id,
        "name": info.name,
        "status": info.status,
        "created_at": _ts(info.created_at),
        "quotas": dataclasses.asdict(info.quotas),
        "default_priority": info.default_priority,
    }


def key_view(info: KeyInfo) -> dict[str, Any]:
    return {
        "object": "api_key",
        "prefix": info.prefix,
        "tenant_id": info.tenant_id,
        "label": info.label,
        "created_at": _ts(info.created_at),
        "revoked_at": _ts(info.revoked_at),
    }


def audit_view(info: AuditInfo) -> dict[str, Any]:
    return {
        "object": "audit_entry",
        "id": info.id,
        "created_at": _ts(info.created_at),
        "actor": info.actor,
        "action": info.action,
        "tenant_id": info.tenant_id,
        "target": info.target,
        "detail": info.detail,
    }


def _registry_call(fn: Any, session: Session, **kwargs: Any) -> Any:
    try:
        return fn(session, **kwargs)
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def create(session: Session, *, name: str, quotas: TenantQuotas | None) -> dict[str, Any]:
    info, api_key = _registry_call(create_tenant, session, name=name, quotas=quotas)
    record_audit(session, actor=ADMIN, action="tenant.create", tenant_id=info.id, target=name)
    return {**tenant_view(info), "api_key": api_key}


def tenants(session: Session) -> list[dict[str, Any]]:
    return [tenant_view(t) for t in list_tenants(session)]


def tenant(session: Session, *, tenant_id: str) -> dict[str, Any]:
    return tenant_view(_registry_call(get_tenant, session, tenant_id=tenant_id))


def set_status(
    session: Session, *, tenant_id: str, status: TenantStatus, fleet_sync: FleetSync
) -> dict[str, Any]:
    """Suspend / activate / delete; in fleet mode every replica also drops the tenant's adapters."""
    change = fleet.set_tenant_status if fleet_sync.is_fleet else set_tenant_status
    info = _registry_call(change, session, tenant_id=tenant_id, status=status)
    fleet_sync.wake()
    record_audit(session, actor=ADMIN, action=f"tenant.{status.value}", tenant_id=tenant_id, target=info.name)
    return tenant_view(info)


def set_quotas(session: Session, *, tenant_id: str, quotas: TenantQuotas) -> dict[str, Any]:
    info = _registry_call(set_tenant_quotas, session, tenant_id=tenant_id, quotas=quotas)
    detail = dataclasses.asdict(quotas)
    record_audit(
        session, actor=ADMIN, action="tenant.quotas", tenant_id=tenant_id, target=info.name, detail=detail
    )
    return tenant_view(info)


def set_priority(session: Session, *, tenant_id: str, default_priority: int) -> dict[str, Any]:
    """The tenant's default priority (lower = more urgent; also the most urgent its requests may ask)."""
    info = _registry_call(
        set_tenant_priority, session, tenant_id=tenant_id, default_priority=default_priority
    )
    record_audit(
        session, actor=ADMIN, action="tenant.priority", tenant_id=tenant_id, target=info.name,
        detail={"default_priority": default_priority},
    )  # fmt: skip
    return tenant_view(info)


def tenant_import_grants(session: Session, *, tenant_id: str) -> dict[str, Any]:
    """The prefixes `tenant_id` may import adapters from."""
    prefixes = _registry_call(get_import_prefixes, session, tenant_id=tenant_id)
    return {"object": "tenant.import_prefixes", "tenant_id": tenant_id, "prefixes": prefixes}


def grant_imports(
    session: Session, *, settings: Settings, tenant_id: str, prefixes: list[str]
) -> dict[str, Any]:
    """Replace the prefixes `tenant_id` may import from; each must lie within the operator's bound
    (400 naming the setting that refuses it)."""
    canonical = [check_grant(settings, prefix) for prefix in prefixes]
    saved = _registry_call(set_import_prefixes, session, tenant_id=tenant_id, prefixes=canonical)
    record_audit(
        session, actor=ADMIN, action="tenant.import_prefixes", tenant_id=tenant_id, detail={"prefixes": saved}
    )
    return {"object": "tenant.import_prefixes", "tenant_id": tenant_id, "prefixes": saved}


def new_key(session: Session, *, tenant_id: str, label: str | None) -> dict[str, Any]:
    info, api_key = _registry_call(issue_key, session, tenant_id=tenant_id, label=label)
    record_audit(session, actor=ADMIN, action="key.issue", tenant_id=tenant_id, target=info.prefix)
    return {**key_view(info), "api_key": api_key}


def keys(session: Session, *, tenant_id: str) -> list[dict[str, Any]]:
    _registry_call(get_tenant, session, tenant_id=tenant_id)
    return [key_view(k) for k in list_keys(session, tenant_id=tenant_id)]


def revoke(session: Session, *, tenant_id: str, prefix: str) -> dict[str, Any]:
    info = _registry_call(revoke_key, session, tenant_id=tenant_id, prefix=prefix)
    record_audit(session, actor=ADMIN, action="key.revoke", tenant_id=tenant_id, target=prefix)
    return key_view(info)


def all_adapters(session: Session, *, residency: Residency, tenant_id: str | None) -> list[dict[str, Any]]:
    versions = list_adapters(session, tenant_id=tenant_id)
    names = {t.id: t.name for t in list_tenants(session, include_deleted=True)}
    views = adapter_views(versions, residency=residency)
    owners = list(dict.fromkeys((v.tenant_id, v.name) for v in versions))
    for view, (owner, _) in zip(views, owners, strict=True):
        view["tenant_id"], view["tenant_name"] = owner, names.get(owner)
    return views


async def pin(
    session: Session,
    *,
    engine: AsyncEngine,
    residency: Residency,
    fleet_sync: FleetSync,
    tenant_id: str,
    name: str,
    version: int | None,
    is_pin: bool,
) -> dict[str, Any]:
    """Pin or unpin a version in the GPU adapter cache: here, and in fleet mode on every replica (the
    pin is state in `fleet_pins`, so replicas started later apply it too)."""
    model = name if version is None else f"{name}@{version}"
    info = await run_in_threadpool(_registry_call, resolve_adapter, session, tenant_id=tenant_id, model=model)
    try:
        await (engine.pin_adapter if is_pin else engine.unpin_adapter)(info.ref)
    except (ValueError, RegistryError) as exc:
        raise APIError(
            409, f"cannot {'pin' if is_pin else 'unpin'} {model}: {exc}", code="pin_failed"
        ) from None
    if fleet_sync.is_fleet:
        change = fleet.pin_adapter if is_pin else fleet.unpin_adapter
        exact = f"{info.name}@{info.version}"
        await run_in_threadpool(_registry_call, change, session, tenant_id=tenant_id, model=exact)
        fleet_sync.wake()
    target = f"{info.name}@{info.version}"
    action = "adapter.pin" if is_pin else "adapter.unpin"
    await run_in_threadpool(
        record_audit, session, actor=ADMIN, action=action, tenant_id=tenant_id, target=target
    )
    return {"object": "adapter.pin", "id": target, "pinned": is_pin, "residency": residency.of(info)}


async def delete_adapter_versions(
    session: Session,
    *,
    engine: AsyncEngine,
    fleet_sync: FleetSync,
    tenant_id: str,
    name: str,
    version: int | None,
) -> dict[str, Any]:
    """Soft-delete a tenant's adapter (one version or all): it stops resolving at once; its pins go,
    here and, in fleet mode, on every replica (which also evict it from their adapter caches)."""
    change = fleet.delete_adapter if fleet_sync.is_fleet else delete_adapter
    deleted = await run_in_threadpool(
        _registry_call, change, session, tenant_id=tenant_id, name=name, version=version
    )
    fleet_sync.wake()
    pinned = engine.stats().adapters.pinned
    for info in deleted:
        if info.ref_id in pinned:
            await engine.unpin_adapter(info.ref)
        await run_in_threadpool(
            record_audit,
            session,
            actor=ADMIN,
            action="adapter.delete",
            tenant_id=tenant_id,
            target=f"{info.name}@{info.version}",
        )
    versions = [d.version for d in deleted]
    return {"object": "adapter.deleted", "name": name, "versions": versions, "deleted": True}


def audit(
    session: Session, *, tenant_id: str | None, limit: int, before_id: int | None
) -> list[dict[str, Any]]:
    entries = _registry_call(list_audit, session, tenant_id=tenant_id, limit=limit, before_id=before_id)
    return [audit_view(e) for e in entries]


def engine_stats(*, engine: AsyncEngine, admission: Admission) -> dict[str, Any]:
    stats = engine.stats()
    return {
        "object": "engine.stats",
        **dataclasses.asdict(stats),
        "kv_cache_usage": stats.kv_cache_usage,
        "num_in_flight": admission.num_in_flight,
        "max_in_flight": admission.max_in_flight,
        "is_draining": admission.is_draining,
    }
