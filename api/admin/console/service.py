"""State-changing console operations that the admin REST service (api/admin/service.py) lacks.

Deleting another tenant's adapter is an operator action: it soft-deletes the version in the
registry (it stops resolving at once, so it is never served again), drops an operator pin so the
GPU slot can be reused (on every replica of a fleet), and records who did it in the audit log.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from api.admin.service import delete_adapter_versions
from api.errors import APIError
from api.fleet.sync import FleetSync
from base_engine.async_engine import AsyncEngine
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
    session: Session, *, engine: AsyncEngine, fleet_sync: FleetSync, tenant_id: str, name: str, version: int
) -> str:
    """Soft-delete `name@version` of the tenant, unpin it (on every replica of a fleet); returns its
    id ("name@version"). The admin REST route does the same (api/admin/service.py)."""
    await delete_adapter_versions(
        session, engine=engine, fleet_sync=fleet_sync, tenant_id=tenant_id, name=name, version=version
    )
    return f"{name}@{version}"
