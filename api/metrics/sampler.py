"""The engine gauges (queues, KV blocks, adapter cache tiers), refreshed every second off the request
path and on each scrape."""

from __future__ import annotations

import logging
import threading

from api.metrics.prometheus import Metrics
from base_engine.async_engine import AsyncEngine
from registry.disk_cache import DiskTier

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0


def refresh_engine_metrics(*, metrics: Metrics, engine: AsyncEngine, disk: DiskTier) -> None:
    metrics.update_engine(engine.stats(), disk_count=len(disk.entries()), disk_bytes=disk.num_bytes)


class MetricsSampler:
    """Refreshes the engine gauges and the recent-samples ring every `interval_s` on its own thread."""

    def __init__(
        self, *, metrics: Metrics, engine: AsyncEngine, disk: DiskTier, interval_s: float = METRICS_INTERVAL_S
    ) -> None:
        self.metrics = metrics
        self.engine = engine
        self.disk = disk
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraserve-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                refresh_engine_metrics(metrics=self.metrics, engine=self.engine, disk=self.disk)
            except Exception:  # noqa: BLE001 - metrics must never take the server down
                logger.exception("metrics refresh failed")
