"""The host tier's byte budget: parsed adapters held in host memory are bounded by bytes as well as by
count, since one adapter with `modules_to_save` copies (a Llama-3-8B lm_head in bf16 is 1.05 GB) weighs
as much as dozens of plain ones.

`max_cpu_lora_bytes` (`LORASERVE_MAX_CPU_LORA_BYTES`) sets it; unset, it is room for `max_cpu_loras`
plain adapters at `max_lora_rank` (a device slot's bytes each) plus one adapter's copies at the
replacement budget (`max_replacement_bytes`), so every adapter that passes that budget fits alone.
The cache (cache.py) evicts by both bounds; an upload whose copies alone exceed the host budget, or
whose file exceeds the disk tier's, is refused with the figures (`check_tier_budgets`)."""

from __future__ import annotations

import torch

from adapters.format import LoraAdapter
from adapters.slots import SlotPool
from adapters.types import AdapterValidationError, BaseModelShapes


def default_cpu_lora_bytes(
    base: BaseModelShapes,
    *,
    max_cpu_loras: int,
    max_lora_rank: int,
    dtype: torch.dtype,
    max_replacement_bytes: int | None,
) -> int:
    """Room for `max_cpu_loras` plain adapters at `max_lora_rank` plus one adapter's full copies."""
    plain = SlotPool.bytes_per_slot(base, max_lora_rank, dtype)
    return max_cpu_loras * plain + (max_replacement_bytes or 0)


def replacement_bytes(adapter: LoraAdapter) -> int:
    """Bytes of the adapter's modules_to_save copies as held (the serving dtype)."""
    return sum(t.numel() * t.element_size() for t in adapter.replacements.values())


def check_tier_budgets(
    adapter: LoraAdapter, file_bytes: int, *, host_bytes: int | None, disk_bytes: int | None
) -> None:
    """Refuse an adapter no tier could hold: its copies above the host tier's bytes, or its weights file
    above the disk tier's; the message gives the needed bytes, the budget and the setting to raise."""
    copies = replacement_bytes(adapter)
    if host_bytes is not None and copies > host_bytes:
        names = ", ".join(f"{n} {list(t.shape)} {t.dtype}" for n, t in adapter.replacements.items())
        raise AdapterValidationError(
            f"modules_to_save copies need {copies} bytes of host memory ({names}), above the host tier's "
            f"budget of {host_bytes} bytes; raise max_cpu_lora_bytes (LORASERVE_MAX_CPU_LORA_BYTES) to "
            "serve it"
        )
    if disk_bytes is not None and file_bytes > disk_bytes:
        raise AdapterValidationError(
            f"adapter_model.safetensors needs {file_bytes} bytes on the local disk tier, above its budget of "
            f"{disk_bytes} bytes; raise disk_cache_bytes (LORASERVE_DISK_CACHE_BYTES) to serve it"
        )
