"""State-changing console operations that the admin REST service (api/admin_service.py) lacks.

Deleting another tenant's adapter is an operator action: it soft-deletes the version in the
registry (it stops resolving at once, so it is never served again), drops an operator pin so the
GPU slot can be reused, and records who did it in the audit log.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.admin_service import ADMIN
from api.errors import APIError, from_registry_error
from api.state import AppState
from registry.adapters import delete_adapter
from registry.audit import record_audit
from registry.errors import RegistryError
from registry.types import QUOTA_MAX, TenantQuotas

logger = logging.getLogger(__name__)
QUOTA_FIELDS = ("rpm", "tpm", "max_concurrent", "max_adapters", "max_adapter_bytes")


def parse_quotas(form: dict[str, str]) -> TenantQuotas:
    """Quota form fields -> TenantQuotas; a blank field means "server default". APIError 400 otherwise."""
    values: dict[str, int | None] = {}
    for name in QUOTA_FIELDS:
        raw = form.get(name, "").strip()
        if not raw:
            values[name] = None
            continue
        if not (raw.isascii() and raw.isdigit()) or int(raw) > QUOTA_MAX[name]:
            raise APIError(
                400,
                f"quota {name} must be a whole number in [0, {QUOTA_MAX[name]}] or blank, got {raw!r}",
                param=name,
            )
        values[name] = int(raw)
    return TenantQuotas(**values)


async def delete_adapter_version(
    state: AppState, session: Session, *, tenant_id: str, name: str, version: int
) -> str:
    """Soft-delete `name@version` of the tenant, unpin it; returns its id ("name@version")."""
    try:
        deleted = await run_in_threadpool(
            delete_adapter, session, tenant_id=tenant_id, name=name, version=version
        )
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    target = f"{name}@{version}"
    await run_in_threadpool(
        record_audit, session, actor=ADMIN, action="adapter.delete", tenant_id=tenant_id, target=target
    )
    for info in deleted:
        if info.ref_id in _pinned(state):
            try:
                await state.engine.unpin_adapter(info.ref)
            except ValueError as exc:  # already gone from the cache: nothing left to release
                logger.info("unpin of deleted adapter %s: %s", info.ref_id, exc)
    return target


def _pinned(state: AppState) -> set[str]:
    pinned = state.engine.stats().adapters.get("pinned", [])
    return {str(p) for p in pinned} if isinstance(pinned, list) else set()
