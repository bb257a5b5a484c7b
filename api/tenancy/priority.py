"""A request's priority class: what it asks for (`priority`, vLLM's field: an integer, lower = more
urgent), bounded by its tenant's default priority, which the admin sets (`PUT
/admin/api/tenants/{id}/priority`, the console, `loraserve tenant priority`).

No `priority` -> the tenant's default. A more urgent level than the tenant's default -> 400 naming
both: a tenant cannot buy its way ahead by asking. A less urgent level is always allowed (a tenant
may mark its own batch work as background). The engine serves levels strictly, with aging
(base_engine/priority.py).
"""

from __future__ import annotations

from api.errors import APIError
from registry.types import TenantInfo


def request_priority(asked: int | None, tenant: TenantInfo) -> int:
    """The level the request runs at; APIError 400 when it asks for more than its tenant allows."""
    allowed = tenant.default_priority
    if asked is None:
        return allowed
    if asked < allowed:
        raise APIError(
            400,
            f"`priority` {asked} is more urgent than tenant {tenant.name!r} may ask for: its default "
            f"priority is {allowed} (lower = more urgent); send priority >= {allowed} or none",
            param="priority",
            code="invalid_value",
        )
    return asked
