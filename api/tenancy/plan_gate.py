"""Fair planning: at most `per_tenant` requests of one tenant are planned at once in this process.

Planning a request (authorising the model, tokenizing the prompt, compiling a grammar) runs on a worker
thread of the shared pool before any quota decision can count its tokens; a long prompt takes that
thread, and a core, for up to ~0.5 s (SmolLM2 at 8192 tokens; longer texts are refused unread, see
base_engine/model/token_bound.py). Without a bound one tenant's burst of long prompts would fill the pool
and every other tenant's requests would wait behind it. Requests past the bound wait their turn on
the event loop, holding no thread, first come first served, behind their own tenant's requests only.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


@dataclass
class _Tenant:
    running: int = 0
    waiting: deque[_Waiter] = field(default_factory=deque)  # first come, first served


class PlanGate:
    """Thread-safe and not tied to one event loop (a slot freed on one loop wakes a waiter on another),
    so one gate serves every loop of the process."""

    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be >= 1, got {per_tenant}")
        self.per_tenant = per_tenant
        self._tenants: dict[str, _Tenant] = {}
        self._lock = threading.Lock()

    @asynccontextmanager
    async def slot(self, tenant_id: str) -> AsyncIterator[None]:
        """Hold one of the tenant's planning slots (waiting for one if all are taken)."""
        await self._acquire(tenant_id)
        try:
            yield
        finally:
            self._release(tenant_id)

    def num_tenants(self) -> int:
        """Tenants with a request planning or waiting (0 when idle: nothing is kept per tenant)."""
        with self._lock:
            return len(self._tenants)

    async def _acquire(self, tenant_id: str) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            tenant = self._tenants.setdefault(tenant_id, _Tenant())
            if tenant.running < self.per_tenant and not tenant.waiting:
                tenant.running += 1
                return
            waiter: _Waiter = (loop, loop.create_future())
            tenant.waiting.append(waiter)
        try:
            await waiter[1]  # resolved by `_release`, which handed its slot over to this request
        except asyncio.CancelledError:
            with self._lock:
                queued = waiter in tenant.waiting
                if queued:
                    tenant.waiting.remove(waiter)
            if not queued and waiter[1].done() and not waiter[1].cancelled():
                self._release(tenant_id)  # handed a slot just as it was cancelled: pass it on
            raise

    def _release(self, tenant_id: str) -> None:
        with self._lock:
            tenant = self._tenants[tenant_id]
            if tenant.waiting:
                loop, future = tenant.waiting.popleft()  # the slot passes on: `running` unchanged
            else:
                tenant.running -= 1
                if tenant.running == 0:
                    del self._tenants[tenant_id]
                return
        try:
            loop.call_soon_threadsafe(self._hand_over, tenant_id, future)
        except RuntimeError:  # the waiter's event loop is closed: nobody there to take the slot
            self._release(tenant_id)

    def _hand_over(self, tenant_id: str, future: asyncio.Future[None]) -> None:
        if future.cancelled():  # its request was cancelled while the slot was on its way
            self._release(tenant_id)
        else:
            future.set_result(None)
