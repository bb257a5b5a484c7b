"""The fleet's affinity signal: which replica holds an adapter, read from each replica's own /metrics
the way llm-d's `lora-load-state-scorer` reads vLLM's residency series (vLLM PR #54830, llm-d-router
PR #2792; our side: api/metrics/residency.py).

- `vllm:lora_adapter_loaded{adapter_name,level,pinned,rank}` = 1 per resident adapter; a series at 0
  or without `adapter_name` is absent; gpu outranks cpu.
- `vllm:num_gpu_loaded_lora_adapters`, `vllm:max_gpu_lora_adapters`: the slots in use and in all
  (a replica with a free slot loads a new adapter without evicting one).

`adapter_name` is the name a client sends (`bot`; the engine id `<tenant>/<name>@<version>` when the
operator turned tenant labels on), so two tenants' `bot` share a series, as in vLLM: the signal is a
preference, never a correctness rule (the chosen replica resolves and loads what the request needs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from api.metrics.prometheus import adapter_label

T = TypeVar("T")

# How much a replica is preferred for an adapter, best first.
GPU_RESIDENT, CPU_RESIDENT, FREE_SLOT, NO_PREFERENCE = 3, 2, 1, 0


@dataclass(frozen=True, slots=True)
class ReplicaResidency:
    loaded: dict[str, str] = field(default_factory=dict)  # adapter_name -> "gpu" | "cpu"
    num_gpu_loaded: int = 0
    max_gpu: int = 0

    def to_stats(self) -> dict[str, Any]:
        """Plain values: what a replica reports to Ray's router (`record_routing_stats`)."""
        return {"loaded": dict(self.loaded), "num_gpu_loaded": self.num_gpu_loaded, "max_gpu": self.max_gpu}

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> ReplicaResidency | None:
        """None when the replica reported nothing yet (just started): no preference either way."""
        if not stats or "loaded" not in stats:
            return None
        return cls(dict(stats["loaded"]), int(stats["num_gpu_loaded"]), int(stats["max_gpu"]))


def parse_residency(exposition: str) -> ReplicaResidency:
    """The residency series of one /metrics exposition."""
    loaded: dict[str, str] = {}
    num_gpu = max_gpu = 0
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == "vllm:lora_adapter_loaded":
                name, level = s.labels.get("adapter_name", ""), s.labels.get("level", "")
                if s.value and name and level in ("gpu", "cpu") and loaded.get(name) != "gpu":
                    loaded[name] = level
            elif s.name == "vllm:num_gpu_loaded_lora_adapters":
                num_gpu = max(num_gpu, int(s.value))
            elif s.name == "vllm:max_gpu_lora_adapters":
                max_gpu = max(max_gpu, int(s.value))
    return ReplicaResidency(loaded, num_gpu, max_gpu)


def preference(residency: ReplicaResidency | None, model_id: str) -> int:
    """How well a replica suits `model_id` (the engine's adapter id, api/fleet/routing.py)."""
    if residency is None:
        return NO_PREFERENCE
    level = residency.loaded.get(model_id) or residency.loaded.get(adapter_label(model_id))
    if level == "gpu":
        return GPU_RESIDENT
    if level == "cpu":
        return CPU_RESIDENT
    return FREE_SLOT if residency.num_gpu_loaded < residency.max_gpu else NO_PREFERENCE


def rank_by_residency(
    candidates: Sequence[T], residency_of: Callable[[T], ReplicaResidency | None], model_id: str
) -> list[list[T]]:
    """`candidates` grouped by `preference`, best group first (one group without a model id)."""
    if not model_id:
        return [list(candidates)] if candidates else []
    groups: dict[int, list[T]] = {}
    for candidate in candidates:
        groups.setdefault(preference(residency_of(candidate), model_id), []).append(candidate)
    return [groups[p] for p in sorted(groups, reverse=True)]
