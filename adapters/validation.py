"""Upload-time validation of a PEFT LoRA adapter against a base model (platform.md section 4.2 checklist).

Safetensors only (pickle is never read); the weights' size is checked before any byte is read; the
header is checked before torch sees the data; every tensor's shape is checked against the base
projection, every rank against `max_lora_rank`, every value for finiteness in the serving dtype, and
the deltas' composed bound through each layer (adapters/composition.py).
The returned `AdapterSummary` carries the sha256 of the exact bytes that were parsed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch

from adapters.composition import check_composition
from adapters.coverage import coverage_report
from adapters.files import read_adapter_files
from adapters.format import parse_adapter
from adapters.host_tier import check_tier_budgets
from adapters.replacements import DEFAULT_MAX_REPLACEMENT_BYTES
from adapters.types import AdapterSummary, AdapterValidationError, BaseModelShapes

__all__ = ["validate_adapter"]

_SERVING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def validate_adapter(
    adapter_dir: Path,
    *,
    base: BaseModelShapes,
    max_lora_rank: int,
    max_size_bytes: int,
    dtype: torch.dtype = torch.float32,
    weight_norms: Mapping[tuple[int, str], float] | None = None,
    max_replacement_bytes: int | None = DEFAULT_MAX_REPLACEMENT_BYTES,
    host_tier_bytes: int | None = None,
    disk_tier_bytes: int | None = None,
) -> AdapterSummary:
    """Check an adapter directory on CPU; raises AdapterFormatError (or a subclass) naming the cause.

    `dtype` is the dtype the engine will serve the factors in: values must stay finite after the cast.
    `weight_norms` (||W||_F per (layer, module) of the served model) give the coverage report's relative
    deltas; an adapter that changes nothing is refused (adapters/coverage.py). `max_replacement_bytes`
    bounds its modules_to_save matrices in `dtype` (adapters/replacements.py); an adapter whose copies
    exceed `host_tier_bytes`, or whose file exceeds `disk_tier_bytes`, is refused (adapters/host_tier.py).
    """
    if dtype not in _SERVING_DTYPES:
        raise AdapterValidationError(
            f"serving dtype {dtype} is not supported; expected one of {_SERVING_DTYPES}"
        )
    if max_lora_rank <= 0 or max_size_bytes <= 0:
        raise AdapterValidationError(f"limits must be positive: {max_lora_rank=}, {max_size_bytes=}")
    # Mapped, not read: validation copies no weight byte into memory (an upload never costs its size in RAM).
    files = read_adapter_files(Path(adapter_dir), max_size_bytes=max_size_bytes, mapped=True)
    try:
        adapter = parse_adapter(
            files, base=base, dtype=dtype, max_lora_rank=max_lora_rank,
            max_replacement_bytes=max_replacement_bytes,
        )  # fmt: skip
        check_composition(adapter.weights, base, dtype)
        check_tier_budgets(
            adapter, len(files.weights_bytes), host_bytes=host_tier_bytes, disk_bytes=disk_tier_bytes
        )
        summary = AdapterSummary(
            ranks=dict(adapter.rank_by_module),
            modules=adapter.modules,
            max_rank=adapter.max_rank,
            num_layers_covered=len(adapter.layers),
            size_bytes=len(files.weights_bytes),
            sha256=hashlib.sha256(files.weights_bytes).hexdigest(),
            config_sha256=hashlib.sha256(files.config_bytes).hexdigest(),
            coverage=coverage_report(adapter, weight_norms),
        )
        del adapter  # its factors view the map
    finally:
        files.close()
    return summary
