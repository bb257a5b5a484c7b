"""Sampling defaults stored with an adapter: applied to the fields a request leaves out, before the
base checkpoint's `generation_config.json` defaults (api/inference/sampling.py), as a checkpoint's own
file is. The demo adapters keep theirs in api/demo/adapters/generation-defaults.json (a repetition
penalty, so a 135M model's greedy answers do not loop); other adapters have none.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

# What an adapter may default: the checkpoint's generation_config keys and the two OpenAI penalties.
ADAPTER_DEFAULT_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"}
)


class AdapterDefaults:
    """(tenant id, adapter name) -> sampling defaults. Thread-safe; set at start-up (the demo tenant)."""

    def __init__(self) -> None:
        self._by_adapter: dict[tuple[str, str], dict[str, float]] = {}
        self._lock = threading.Lock()

    def set(self, tenant_id: str, adapter_name: str, defaults: Mapping[str, float]) -> None:
        unknown = sorted(set(defaults) - ADAPTER_DEFAULT_KEYS)
        if unknown:
            raise ValueError(
                f"adapter {adapter_name!r} defaults name {unknown}; "
                f"expected some of {sorted(ADAPTER_DEFAULT_KEYS)}"
            )
        with self._lock:
            self._by_adapter[tenant_id, adapter_name] = {k: float(v) for k, v in defaults.items()}

    def get(self, tenant_id: str, adapter_name: str | None) -> dict[str, float]:
        if adapter_name is None:
            return {}
        with self._lock:
            return dict(self._by_adapter.get((tenant_id, adapter_name), {}))
