"""One engine replica of the fleet as a Ray Serve deployment: our normal app, served in-process.

Each replica builds the same `AppState` and FastAPI app as `loraserve serve` (api/bootstrap.py,
api/app.py) with `fleet=True` and `replica_id` = Ray's replica id, starts it (the app's lifespan: the
engine thread, metering, the fleet agent of api/fleet/agent.py), and answers
`handle(request, assigned)` by driving the app with the request (api/fleet/asgi_bridge.py),
streaming `ResponseStart` and body chunks back to the ingress. The replica does all authentication,
resolution, quotas and metering itself; the ingress only chose it.

Adapters: `@serve.multiplexed` (installed per instance, sized by `max_loras`) keeps Ray's belief of
what this replica holds. Its loader prefetches the adapter into this engine's adapter cache and waits
until it is resident, so the request that triggered it finds it loaded (the first request does not
pay twice). Ray's LRU eviction only lets the adapter go: the engine's own LRU frees its slot when it
needs one (a multiplexing pin could hold every slot and starve requests routed without affinity).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from api.context import AssignedId, assigned_request_id
from api.fleet.asgi_bridge import HttpRequest, ResponseStart, stream_asgi
from api.fleet.residency_signal import parse_residency
from api.fleet.routing import parse_model_id
from api.settings import Settings, load_settings
from registry.adapters import resolve_adapter
from registry.errors import NotFound
from registry.types import AdapterVersionInfo

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-loraserve-replica"  # which replica answered (tests, debugging, load balancer logs)
RESIDENT_HEADER = b"x-loraserve-adapter-resident"  # "1": the adapter was in this engine on arrival
PREFETCH_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ResidentAdapter:
    """What Ray's multiplexing keeps per model id: the version it resolved to (None: not servable)."""

    model_id: str
    info: AdapterVersionInfo | None


def replica_settings(overrides: dict[str, Any], *, replica_id: str, rank: int) -> Settings:
    """The fleet's settings for this replica: its own data dir (journal, disk tier, uploads) under
    the shared one, and the model resolved in the shared data dir (made once by the launcher)."""
    from api.bootstrap import resolve_model

    shared = load_settings(**overrides)
    return shared.model_copy(
        update={
            "fleet": True,
            "replica_id": replica_id,
            "data_dir": shared.data_dir / "replicas" / f"rank-{rank}",
            "model": resolve_model(shared),
            "served_model_name": shared.model_name,
        }
    )


async def serve_assigned(
    app: Any, request: HttpRequest, assigned: AssignedId | None, extra: list[tuple[bytes, bytes]]
) -> AsyncIterator[ResponseStart | bytes]:
    """`request` through the app with the ingress's id as the request's own; `extra` headers added."""
    token = assigned_request_id.set(assigned)
    try:
        async for chunk in stream_asgi(app, request):
            if isinstance(chunk, ResponseStart):
                chunk = ResponseStart(chunk.status, [*chunk.headers, *extra])
            yield chunk
    finally:
        with contextlib.suppress(ValueError):  # a generator may be finalized in another context
            assigned_request_id.reset(token)


async def scrape_residency(app: Any) -> dict[str, Any]:
    """The app's own `GET /metrics`, its residency series parsed (api/fleet/residency_signal.py), as
    a router outside Ray scrapes them; {} (no preference) when /metrics did not answer."""
    chunks = [c async for c in stream_asgi(app, HttpRequest("GET", "/metrics"))]
    start, body = chunks[0], b"".join(c for c in chunks[1:] if isinstance(c, bytes))
    if not isinstance(start, ResponseStart) or start.status != 200:
        return {}
    return parse_residency(body.decode()).to_stats()


class LoraReplica:
    """Ray Serve deployment class (wrapped by `serve.deployment` in api/fleet/ray_app.py)."""

    async def __init__(self, overrides: dict[str, Any]) -> None:
        from api.app import create_app
        from api.bootstrap import build_state

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        settings = await asyncio.to_thread(
            replica_settings, overrides, replica_id=self.replica_id, rank=context.rank.rank
        )
        self.state = await asyncio.to_thread(build_state, settings)
        self.app = create_app(self.state)
        self._lifespan = self.app.router.lifespan_context(self.app)
        # The app's lifespan (api/app.py): engine thread, metering and, as fleet=True, the replica
        # agent (api/fleet/agent.py: heartbeat, residency, pin/unpin/delete events from other replicas).
        await self._lifespan.__aenter__()

        async def make_resident(model_id: str) -> ResidentAdapter:  # a function: Ray caches on it
            return await self._make_resident(model_id)

        self._load_adapter = serve.multiplexed(max_num_models_per_replica=settings.max_loras)(make_resident)
        logger.info("replica %s serving %s", self.replica_id, self.state.model_name)

    async def handle(
        self, request: HttpRequest, assigned: AssignedId | None
    ) -> AsyncIterator[ResponseStart | bytes]:
        """Streams the app's answer to `request`; `assigned` (the ingress's id) becomes the response id."""
        model_id = serve.get_multiplexed_model_id()
        extra = [(REPLICA_HEADER, self.replica_id.encode())]
        if model_id:
            is_resident = self._is_resident(model_id)
            await self._load_adapter(model_id)
            extra.append((RESIDENT_HEADER, b"1" if is_resident else b"0"))
        async for chunk in serve_assigned(self.app, request, assigned, extra):
            yield chunk

    def _is_resident(self, model_id: str) -> bool:
        # model ids are the engine's adapter ids (api/fleet/routing.py), as of the engine's last step
        return model_id in self.state.engine.adapter_residency()

    async def _make_resident(self, model_id: str) -> ResidentAdapter:
        """Ray's multiplexed loader: start loading into this engine's adapter cache and wait for it."""
        info = await asyncio.to_thread(self._resolve, model_id)
        if info is None:
            return ResidentAdapter(model_id, None)  # the request's own resolution answers 404
        ref = info.ref

        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(PREFETCH_TIMEOUT_S, self.state.settings.request_timeout_s)
        wait_s = 0.02  # doubling to 0.2 s: a slow load is not polled 50 times a second per adapter
        while not await self.state.engine.prefetch_adapter(ref) and loop.time() < deadline:
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, 0.2)
        return ResidentAdapter(model_id, info)

    def _resolve(self, model_id: str) -> AdapterVersionInfo | None:
        try:
            tenant_id, model = parse_model_id(model_id)
            with self.state.sessions() as session:
                return resolve_adapter(session, tenant_id=tenant_id, model=model)
        except (ValueError, NotFound):
            return None

    async def record_routing_stats(self) -> dict[str, Any]:
        """What Ray's router (api/fleet/residency_router.py) reads: this replica's residency."""
        return await scrape_residency(self.app)

    async def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread died is restarted."""
        if not self.state.engine_is_running:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running")

    async def __del__(self) -> None:
        """Graceful stop (scale-down, redeploy): flush usage, stop the engine (the app's lifespan)."""
        await self._lifespan.__aexit__(None, None, None)
