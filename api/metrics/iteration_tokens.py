"""`vllm:iteration_tokens_total`: a histogram of the tokens each engine step computed (vLLM's buckets,
base_engine/outputs.py `ITERATION_TOKEN_BUCKETS`). The engine counts every step itself; this collector
exposes its latest snapshot (`EngineStats.iteration_token_counts`), so no step is lost between samples."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Metric

from api.metrics.series import ENGINE
from base_engine.outputs import ITERATION_TOKEN_BUCKETS

NAME = "vllm:iteration_tokens_total"


class IterationTokens:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self._counts: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._sum = 0
        self._lock = threading.Lock()
        registry.register(self)

    def update(self, counts: tuple[int, ...], total: int) -> None:
        """The engine's counts per bucket (then above the last) and the sum of tokens."""
        if len(counts) == len(self._counts):
            with self._lock:
                self._counts, self._sum = counts, total

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, total = self._counts, self._sum
        cumulative = list(itertools.accumulate(counts))
        bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        # Built sample by sample: HistogramMetricFamily would drop the "_total" vLLM's name keeps.
        family = Metric(NAME, "Histogram of number of tokens per engine_step.", "histogram")
        labels = {"model_name": self.model_name, "engine": ENGINE}
        for bound, count in zip(bounds, cumulative, strict=True):
            family.add_sample(f"{NAME}_bucket", {**labels, "le": bound}, float(count))
        family.add_sample(f"{NAME}_count", labels, float(cumulative[-1]))
        family.add_sample(f"{NAME}_sum", labels, float(total))
        yield family
