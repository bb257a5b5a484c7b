"""loraserve's serving engine: paged KV cache, continuous batching, Llama-family models.

Names are imported lazily so that `import base_engine.testing.checkpoint` does not load the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "base_engine.llm",
    "AsyncEngine": "base_engine.async_engine",
    "EngineRequest": "base_engine.async_engine",
    "LLMEngine": "base_engine.engine",
    "EngineConfig": "base_engine.engine_config",
    "EngineStats": "base_engine.outputs",
    "RequestMetrics": "base_engine.outputs",
    "RequestOutput": "base_engine.outputs",
    "SamplingParams": "base_engine.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'base_engine' has no attribute {name!r}")
