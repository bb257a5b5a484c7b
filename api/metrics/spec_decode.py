"""vLLM's speculative decoding counters, per adapter: `vllm:spec_decode_num_drafts_total`,
`vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position}` (0 = the first draft token), as vLLM's V1
engine names them (`vllm/v1/spec_decode/metrics.py`), with our `lora_name` label: the adapter as clients
name it in `model` ("" = the base model, so the base's series read exactly as vLLM's).

The engine counts every verified draft itself (`EngineStats.spec_decode`); this collector exposes its
latest snapshot, so nothing is lost between samples. Without speculation there are no series (as in
vLLM, which registers them only with a speculative config).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Metric

from api.metrics.series import ENGINE
from base_engine.outputs import SpecDecodeCounts

PREFIX = "vllm:spec_decode_num_"
_HELP = {
    "drafts": "Number of spec decoding drafts.",
    "draft_tokens": "Number of draft tokens.",
    "accepted_tokens": "Number of accepted tokens.",
    "accepted_tokens_per_pos": "Accepted tokens per draft position.",
}


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self._counts: dict[str, SpecDecodeCounts] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def update(self, counts: dict[str, SpecDecodeCounts]) -> None:
        """The engine's snapshot, keyed by adapter name as clients send it (a name two tenants use is
        one series, as in `vllm:lora_adapter_loaded`)."""
        with self._lock:
            self._counts = dict(counts)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts = self._counts
        if not counts:
            return
        for what in ("drafts", "draft_tokens", "accepted_tokens"):
            family = Metric(f"{PREFIX}{what}", _HELP[what], "counter")
            for lora, c in sorted(counts.items()):
                value = getattr(c, f"num_{what}")
                family.add_sample(f"{PREFIX}{what}_total", self._labels(lora), float(value))
            yield family
        per_pos = Metric(f"{PREFIX}accepted_tokens_per_pos", _HELP["accepted_tokens_per_pos"], "counter")
        for lora, c in sorted(counts.items()):
            for position, value in enumerate(c.num_accepted_tokens_per_pos):
                labels = {**self._labels(lora), "position": str(position)}
                per_pos.add_sample(f"{PREFIX}accepted_tokens_per_pos_total", labels, float(value))
        yield per_pos

    def _labels(self, lora: str) -> dict[str, str]:
        return {"model_name": self.model_name, "engine": ENGINE, "lora_name": lora}
