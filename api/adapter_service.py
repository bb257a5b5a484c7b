"""Adapter REST service functions (tenant side) and the JSON views shared with the admin API.

Upload: the body is streamed into a temporary directory (api/uploads.py), then the registry
validates it against the served base model (`adapters.validation`) *before* anything is stored and
records a ready version; 201 is sent only then. Reads and deletes are scoped to the caller's
tenant: another tenant's adapter is the same 404 as an unknown name.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fastapi import Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.deps import Caller
from api.errors import from_registry_error
from api.state import AppState
from api.uploads import receive_adapter_upload
from registry.adapters import delete_adapter, get_adapter, list_adapters, register_adapter_version
from registry.audit import record_audit
from registry.errors import RegistryError
from registry.types import AdapterVersionInfo


def version_view(state: AppState, info: AdapterVersionInfo) -> dict[str, Any]:
    return {
        "object": "adapter.version",
        "id": f"{info.name}@{info.version}",
        "name": info.name,
        "version": info.version,
        "status": info.status,
        "base_model": info.base_model,
        "sha256": info.sha256,
        "config_sha256": info.config_sha256,
        "rank": info.max_rank,
        "ranks": info.ranks,
        "modules": list(info.modules),
        "size": info.size_bytes,
        "created_at": int(info.created_at.timestamp()),
        "residency": state.residency(info),
    }


def adapter_views(state: AppState, versions: list[AdapterVersionInfo]) -> list[dict[str, Any]]:
    """One entry per (tenant, name), versions oldest first; `latest_version` is what `name` resolves to."""
    grouped: dict[tuple[str, str], list[AdapterVersionInfo]] = {}
    for info in versions:
        grouped.setdefault((info.tenant_id, info.name), []).append(info)
    return [
        {
            "object": "adapter",
            "name": name,
            "latest_version": max(v.version for v in infos),
            "versions": [version_view(state, v) for v in sorted(infos, key=lambda v: v.version)],
        }
        for (_, name), infos in grouped.items()
    ]


def _register(state: AppState, caller: Caller, name: str, files_dir: Path) -> AdapterVersionInfo:
    with state.sessions() as session:
        info = register_adapter_version(
            session,
            state.store,
            tenant_id=caller.tenant.id,
            name=name,
            files_dir=files_dir,
            validate=state.validator(),
            base_model=state.model_name,
        )
        record_audit(
            session,
            actor=caller.actor,
            action="adapter.upload",
            tenant_id=caller.tenant.id,
            target=f"{info.name}@{info.version}",
            detail={"sha256": info.sha256, "size": info.size_bytes},
        )
    return info


async def upload_adapter(*, state: AppState, request: Request, caller: Caller) -> dict[str, Any]:
    uploads = state.settings.data_dir / "uploads"
    uploads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=uploads) as tmp:
        name = await receive_adapter_upload(request, Path(tmp), max_bytes=state.settings.max_upload_bytes)
        try:
            info = await run_in_threadpool(_register, state, caller, name, Path(tmp))
        except RegistryError as exc:
            raise from_registry_error(exc) from None
    return version_view(state, info)


def list_own_adapters(*, state: AppState, session: Session, caller: Caller) -> list[dict[str, Any]]:
    return adapter_views(state, list_adapters(session, tenant_id=caller.tenant.id))


def get_own_adapter(*, state: AppState, session: Session, caller: Caller, name: str) -> dict[str, Any]:
    try:
        versions = get_adapter(session, tenant_id=caller.tenant.id, name=name)
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    return adapter_views(state, versions)[0]


def delete_own_adapter(*, session: Session, caller: Caller, name: str, version: int | None) -> dict[str, Any]:
    try:
        deleted = delete_adapter(session, tenant_id=caller.tenant.id, name=name, version=version)
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    record_audit(
        session,
        actor=caller.actor,
        action="adapter.delete",
        tenant_id=caller.tenant.id,
        target=name if version is None else f"{name}@{version}",
    )
    return {
        "object": "adapter.deleted",
        "name": name,
        "versions": [d.version for d in deleted],
        "deleted": True,
    }
