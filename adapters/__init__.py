"""PEFT LoRA adapters: format, fail-closed validation, the device/host adapter cache (see README.md).

Names are imported lazily so that `import adapters.types` (what the registry needs) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LORA_MODULES": "adapters.types",
    "AdapterFormatError": "adapters.types",
    "AdapterRef": "adapters.types",
    "AdapterSummary": "adapters.types",
    "AdapterValidationError": "adapters.types",
    "BaseModelShapes": "adapters.types",
    "LoraAdapter": "adapters.format",
    "LoraPair": "adapters.format",
    "load_adapter": "adapters.format",
    "validate_adapter": "adapters.validation",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'adapters' has no attribute {name!r}")
