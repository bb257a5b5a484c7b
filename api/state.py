"""Everything the app needs at run time, built once at start-up (api/bootstrap.py) and shared by routes.

Seams for the metering / metrics / quota layer (issue 7):
- `plan_checks`: `check(tenant_id, quotas)`, run before a request is planned (tokenized); raise
  `APIError` to refuse it at no cost (a tenant already over its rate limits).
- `admission_checks`: `check(ctx) -> release | None`, run before any engine work; raise
  `APIError(429, ...)` to refuse, put `x-ratelimit-*` into `ctx.response_headers`; the returned
  `release(usage | None)` runs once when the request ends (`ctx.estimated_tokens` for estimates), or
  with `admission.NOT_ADMITTED` when a later check or the server's bound (503) refused the request.
- `on_admitted`: `hook(ctx)` once the request is admitted (journal it as begun).
- `on_progress`: `hook(ctx, usage)` as a stream hands tokens to its client (usage so far; must
  not block: it runs on the event loop).
- `inflight.on_request_finished`: `hook(ctx, finals)` once per request when all its engine requests
  ended, aborted and failed ones included; bill `api.context.compute_usage(finals, n=ctx.n)`.
- `engine.on_finished`: every finished engine request (`inflight.get(out.request_id)` -> context).
- `on_drain`: run on shutdown after in-flight requests ended (flush buffers there).

Blocking work that can hang on a dependency (upload validation, object store, database for
uploads, /ready probes) runs in `pools` (api/http/blocking.py), never in anyio's default thread pool.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from adapters.types import AdapterSummary, BaseModelShapes
from adapters.validation import validate_adapter
from api.context import RequestContext, Usage
from api.demo.tenant import DemoInfo
from api.fleet.agent import ReplicaAgent
from api.fleet.snapshot import ThisReplica, replica_id_of
from api.fleet.sync import FleetSync
from api.http.blocking import BlockingPools, Probe, UploadGate
from api.inference.adapter_fetch import AdapterFetch
from api.inference.sampling import SeedSource
from api.metering.meter import UsageMeter
from api.metrics.prometheus import Metrics
from api.settings import Settings
from api.tenancy.admission import Admission, InFlight, Release
from api.tenancy.keyfiles import tenant_cache_salt
from api.tenancy.plan_gate import PlanGate
from api.tenancy.quotas import QuotaLimiter
from api.tenant_adapters.registrar import Registrar
from api.tenant_adapters.uploads import UploadLimits, upload_limits
from api.tenant_adapters.views import Residency
from base_engine.async_engine import AsyncEngine
from base_engine.runner.device import DTYPES
from registry.disk_cache import DiskTier
from registry.provenance import Provenance
from registry.store import ObjectStore
from registry.types import TenantQuotas

logger = logging.getLogger(__name__)

AdmissionCheck = Callable[[RequestContext], Release | None]


@dataclass
class AppState:
    settings: Settings
    engine: AsyncEngine
    sessions: sessionmaker[Session]
    store: ObjectStore
    disk: DiskTier
    admin_key: str
    server_secret: str
    model_name: str  # the base model's served name (`model` in requests, first in /v1/models)
    base_shapes: BaseModelShapes
    admission: Admission
    inflight: InFlight = field(default_factory=InFlight)
    started_at: int = field(default_factory=lambda: int(time.time()))
    plan_checks: list[Callable[[str, TenantQuotas | None], None]] = field(default_factory=list)
    admission_checks: list[AdmissionCheck] = field(default_factory=list)
    on_admitted: list[Callable[[RequestContext], None]] = field(default_factory=list)
    on_progress: list[Callable[[RequestContext, Usage], None]] = field(default_factory=list)
    on_drain: list[Callable[[], Any]] = field(default_factory=list)  # sync or async; run once
    demo: DemoInfo | None = None
    # Issue 7, set by api.metering.service.install: usage meter, Prometheus metrics, rate limits.
    meter: UsageMeter | None = None
    metrics: Metrics | None = None
    quotas: QuotaLimiter | None = None
    admin_key_created: bool = False
    adapter_fetch: AdapterFetch | None = None  # the engine's fetch; knows store outages (503)
    fleet_agent: ReplicaAgent | None = None  # in fleet mode, started by the app's lifespan
    # Issue 18: the process-wide half of every answer's provenance (api/inference/provenance.py), read at
    # start-up.
    provenance: Provenance | None = None
    # Issue 13, built in __post_init__: own thread pools, the upload bound and limits, /ready probes.
    pools: BlockingPools = field(init=False)
    upload_gate: UploadGate = field(init=False)
    upload_limits: UploadLimits = field(init=False)
    ready_probes: dict[str, Probe] = field(init=False)
    seeds: SeedSource = field(init=False)  # for requests that send no seed (api/inference/sampling.py)
    plan_gate: PlanGate = field(init=False)  # per-tenant bound on requests being planned at once
    residency: Residency = field(init=False)  # where an adapter version lives now
    registrar: Registrar = field(init=False)  # what adapter uploads and imports work with
    replica: ThisReplica = field(init=False)  # this process as the fleet (and GET /admin/api/fleet) sees it
    fleet_sync: FleetSync = field(init=False)  # how admin actions here reach the other replicas

    def __post_init__(self) -> None:
        # Each fleet replica draws its own stream (a single server: the seed alone, the same every start).
        replica = self.settings.replica_name if self.settings.fleet else None
        self.seeds = SeedSource(self.settings.seed, replica)
        self.pools = BlockingPools(max_uploads=self.settings.max_concurrent_uploads)
        self.upload_gate = UploadGate(self.settings.max_concurrent_uploads)
        self.plan_gate = PlanGate(self.settings.max_concurrent_plans_per_tenant)
        self.upload_limits = upload_limits(self.settings, self.base_shapes)
        self.ready_probes = {
            "database": Probe("database", self._ping_database, self.pools.probes),
            "object_store": Probe("object_store", self.store.check, self.pools.probes),
        }
        self.on_drain.append(self.pools.shutdown)
        self.residency = Residency(self.engine, self.disk)
        self.registrar = Registrar(
            sessions=self.sessions,
            store=self.store,
            validate=self.validator(),
            base_model=self.model_name,
            residency=self.residency,
            gate=self.upload_gate,
            pool=self.pools.uploads,
            limits=self.upload_limits,
            uploads_dir=self.settings.data_dir / "uploads",
            timeout_s=self.settings.upload_timeout_s,
        )
        self.replica = ThisReplica(
            replica_id=replica_id_of(self.settings),
            started_at=self.started_at,
            is_fleet=self.settings.fleet,
            engine=self.engine,
            admission=self.admission,
            disk=self.disk,
        )
        self.fleet_sync = FleetSync(is_fleet=self.settings.fleet)

    def _ping_database(self) -> None:
        with self.sessions() as session:
            session.execute(text("SELECT 1"))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def engine_is_running(self) -> bool:
        return self.engine.is_running

    def cache_salt(self, tenant_id: str) -> bytes:
        return tenant_cache_salt(self.server_secret, tenant_id)

    def validator(self) -> Callable[[Path], AdapterSummary]:
        """`validate_adapter` bound to the served base model and this server's limits."""
        return functools.partial(
            validate_adapter,
            base=self.base_shapes,
            max_lora_rank=self.settings.max_lora_rank,
            max_size_bytes=self.upload_limits.weights_bytes,
            dtype=self.engine.dtype if self.settings.dtype == "auto" else DTYPES[self.settings.dtype],
        )

    async def run_drain_hooks(self) -> None:
        hooks, self.on_drain = list(self.on_drain), []
        for hook in hooks:
            try:
                result = hook()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - one failing hook must not stop the others
                logger.exception("drain hook %r failed", hook)
