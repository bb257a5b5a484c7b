"""Adapter residency as vLLM names it (`vllm:lora_adapter_loaded` and friends, series.py
`ResidencySeries`), from the engine's `AdapterCacheStats`.

One series per resident adapter at its best level (gpu outranks cpu, as the llm-d scorer reads it),
`adapter_name` = the name a client sends (two tenants' adapters of one name share a series: gpu
wins, pinned if either is); evicted adapters' series disappear at the next refresh. The load-time
histogram observes each load / activation once: the engine hands over its latest durations and the
totals, and only the durations past the last totals seen are new.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Histogram

from api.metrics.series import ENGINE, ResidencySeries
from base_engine.outputs import AdapterCacheStats


@dataclass(frozen=True, slots=True)
class ResidentSeries:
    """One `vllm:lora_adapter_loaded` series' labels."""

    adapter_name: str
    level: str  # "gpu" | "cpu"
    pinned: bool
    rank: int


def resident_series(a: AdapterCacheStats, label: Callable[[str], str]) -> list[ResidentSeries]:
    """The residency series of one snapshot, sorted by adapter name; `label` maps an engine id to the
    client's name."""
    pinned = set(a.pinned)
    best: dict[str, ResidentSeries] = {}
    for ref_id, level in a.residency.items():
        name = label(ref_id)
        new = ResidentSeries(name, level, ref_id in pinned, a.ranks.get(ref_id, 0))
        old = best.get(name)
        if old is not None:
            level = "gpu" if "gpu" in (old.level, new.level) else "cpu"
            new = ResidentSeries(name, level, old.pinned or new.pinned, max(old.rank, new.rank))
        best[name] = new
    return [best[name] for name in sorted(best)]


class _NewDurations:
    """Feeds a histogram the durations of events counted by an engine total, each once."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.last: int | None = None

    def update(self, total: int, recent: tuple[float, ...]) -> None:
        # A total below the last one means a new engine counting from 0: all its durations are new.
        previous = 0 if self.last is None or total < self.last else self.last
        new = min(total - previous, len(recent))
        for seconds in recent[len(recent) - new :]:
            self.histogram.observe(seconds)
        self.last = total


class ResidencyMetrics:
    """Keeps the residency series equal to the engine's last snapshot."""

    def __init__(self, series: ResidencySeries, model_name: str) -> None:
        self.series = series
        self.model_name = model_name
        self._loads = _NewDurations(series.load_seconds)
        self._activations = _NewDurations(series.activate_seconds)

    def update(self, a: AdapterCacheStats, label: Callable[[str], str]) -> None:
        s = self.series
        s.loaded.clear()
        for r in resident_series(a, label):
            pinned = "true" if r.pinned else "false"
            s.loaded.labels(self.model_name, ENGINE, r.adapter_name, r.level, pinned, str(r.rank)).set(1)
        s.num_gpu.set(a.num_gpu)
        s.num_cpu.set(a.num_cpu)
        s.max_gpu.set(a.num_slots)
        self._loads.update(a.loads, a.recent_load_seconds)
        self._activations.update(a.misses, a.recent_activate_seconds)
