"""Upload slots per tenant as well as server-wide, so one tenant cannot hold every slot.

A registration (multipart upload or import by reference) takes a slot before its body is read and
keeps it until its worker ends. Server-wide there are `max_concurrent_uploads` (api/http/blocking.py
`UploadGate`: the upload pool has that many threads); one tenant may hold at most
`max_concurrent_uploads_per_tenant` of them, so a tenant whose clients trickle their bodies (or whose
uploads hang on a slow store) fills only its own share and the others still upload. Refusals say which
bound was met (429 `too_many_uploads`, api/tenant_adapters/service.py).
"""

from __future__ import annotations

import enum
import threading

from api.http.blocking import UploadGate


class UploadRefusal(enum.Enum):
    TENANT = "tenant"  # the tenant already holds its share
    SERVER = "server"  # every slot of the server is taken


class TenantUploadGate:
    """`server` slots in all, at most `per_tenant` of one tenant; `try_enter` never waits."""

    def __init__(self, server: UploadGate, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be >= 1, got {per_tenant}")
        self.server = server
        self.per_tenant = per_tenant
        self._active: dict[str, int] = {}  # tenant id -> slots it holds (absent: none)
        self._lock = threading.Lock()

    def try_enter(self, tenant_id: str) -> UploadRefusal | None:
        """None when a slot was taken for `tenant_id` (give it back with `leave`), else the bound met."""
        with self._lock:
            held = self._active.get(tenant_id, 0)
            if held >= self.per_tenant:
                return UploadRefusal.TENANT
            if not self.server.try_enter():
                return UploadRefusal.SERVER
            self._active[tenant_id] = held + 1
            return None

    def leave(self, tenant_id: str) -> None:
        with self._lock:
            held = self._active.get(tenant_id, 0)
            if held <= 0:
                raise RuntimeError(f"TenantUploadGate.leave for {tenant_id!r} without a matching try_enter")
            if held == 1:
                del self._active[tenant_id]
            else:
                self._active[tenant_id] = held - 1
            self.server.leave()

    def held_by(self, tenant_id: str) -> int:
        with self._lock:
            return self._active.get(tenant_id, 0)
