"""PEFT LoRA adapters: format, fail-closed validation against a base model (see adapters/README.md)."""

from adapters.format import LoraAdapter, LoraPair, load_adapter
from adapters.types import (
    LORA_MODULES,
    AdapterFormatError,
    AdapterRef,
    AdapterSummary,
    AdapterValidationError,
    BaseModelShapes,
)
from adapters.validation import validate_adapter

__all__ = [
    "LORA_MODULES",
    "AdapterFormatError",
    "AdapterRef",
    "AdapterSummary",
    "AdapterValidationError",
    "BaseModelShapes",
    "LoraAdapter",
    "LoraPair",
    "load_adapter",
    "validate_adapter",
]
