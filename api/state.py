"""Everything the app needs at run time, built once at start-up (api/bootstrap.py) and shared by routes.

Only the composition root (api/bootstrap.py, api/app.py) and the route layer (api/deps.py,
api/routes/) see `AppState`; services take the collaborators they use. The request path's are
bundled in `inference` (api/inference/services.py): quotas, meter, admission, in-flight requests,
plan gate, seeds, provenance. What stops at shutdown is stopped by name in api/app.py's `shut_down`.

Blocking work that can hang on a dependency (upload validation, object store, database for
uploads, /ready probes) runs in `pools` (api/http/blocking.py), never in anyio's default thread pool.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from adapters.host_tier import default_cpu_lora_bytes
from adapters.types import AdapterSummary, BaseModelShapes
from adapters.validation import validate_adapter
from api.demo.tenant import DemoInfo
from api.fleet.agent import ReplicaAgent
from api.fleet.snapshot import ThisReplica, replica_id_of
from api.fleet.sync import FleetSync
from api.http.blocking import BlockingPools, Probe, UploadGate
from api.inference.services import Inference
from api.metrics.prometheus import Metrics
from api.metrics.sampler import MetricsSampler
from api.settings import Settings
from api.tenancy.admission import Admission
from api.tenancy.key_precheck import KeyPrecheck
from api.tenancy.keyfiles import tenant_cache_salt
from api.tenant_adapters.registrar import Registrar
from api.tenant_adapters.upload_gate import TenantUploadGate
from api.tenant_adapters.uploads import UploadLimits, upload_limits
from api.tenant_adapters.views import Residency
from base_engine.async_engine import AsyncEngine
from base_engine.runner.device import DTYPES
from registry.disk_cache import DiskTier
from registry.store import ObjectStore

logger = logging.getLogger(__name__)


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
    inference: Inference  # the request path's collaborators
    metrics: Metrics  # Prometheus: /metrics, the console's charts, the fleet's snapshots
    metrics_sampler: MetricsSampler  # refreshes the engine gauges; stopped at shutdown
    started_at: int = field(default_factory=lambda: int(time.time()))
    demo: DemoInfo | None = None
    admin_key_created: bool = False
    fleet_agent: ReplicaAgent | None = None  # in fleet mode, started by the app's lifespan
    # vLLM's --api-key -> an issued key of its tenant (api/http/key_alias.py)
    static_key_alias: tuple[str, str] | None = None
    # Built in __post_init__: own thread pools, the upload bound and limits, /ready probes.
    pools: BlockingPools = field(init=False)
    upload_gate: TenantUploadGate = field(init=False)
    upload_limits: UploadLimits = field(init=False)
    ready_probes: dict[str, Probe] = field(init=False)
    residency: Residency = field(init=False)  # where an adapter version lives now
    registrar: Registrar = field(init=False)  # what adapter uploads and imports work with
    replica: ThisReplica = field(init=False)  # this process as the fleet (and GET /admin/api/fleet) sees it
    fleet_sync: FleetSync = field(init=False)  # how admin actions here reach the other replicas
    key_precheck: KeyPrecheck = field(init=False)  # forged keys refused before their body is read

    def __post_init__(self) -> None:
        self.pools = BlockingPools(max_uploads=self.settings.max_concurrent_uploads)
        self.upload_gate = TenantUploadGate(
            UploadGate(self.settings.max_concurrent_uploads),
            per_tenant=min(
                self.settings.max_concurrent_uploads_per_tenant, self.settings.max_concurrent_uploads
            ),
        )
        self.upload_limits = upload_limits(self.settings, self.base_shapes)
        self.ready_probes = {
            "database": Probe("database", self._ping_database, self.pools.probes),
            "object_store": Probe("object_store", self.store.check, self.pools.probes),
        }
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
        self.key_precheck = KeyPrecheck(
            sessions=self.sessions, pool=self.pools.keys, timeout_s=self.settings.db_timeout_s
        )

    def _ping_database(self) -> None:
        with self.sessions() as session:
            session.execute(text("SELECT 1"))

    @property
    def admission(self) -> Admission:
        return self.inference.admission

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
        """`validate_adapter` bound to the served base model and this server's limits (the host and disk
        tiers' bytes among them: an adapter no tier could hold is refused at upload)."""
        dtype = self.engine.dtype if self.settings.dtype == "auto" else DTYPES[self.settings.dtype]
        host_bytes = self.settings.max_cpu_lora_bytes or default_cpu_lora_bytes(
            self.base_shapes, max_cpu_loras=self.settings.max_cpu_loras,
            max_lora_rank=self.settings.max_lora_rank, dtype=self.engine.dtype,
            max_replacement_bytes=self.settings.max_replacement_bytes,
        )  # fmt: skip
        return functools.partial(
            validate_adapter,
            base=self.base_shapes,
            max_lora_rank=self.settings.max_lora_rank,
            max_size_bytes=self.upload_limits.weights_bytes,
            dtype=dtype,
            weight_norms=self.engine.base_weight_norms,
            max_replacement_bytes=self.settings.max_replacement_bytes,
            host_tier_bytes=host_bytes,
            disk_tier_bytes=self.settings.disk_cache_bytes,
        )
