"""Device memory plan: adapter slots first (the configured number, or a refusal with the figures),
then the KV pool: an explicit count, a fraction of the free device memory left after the slots, or on
CPU a fixed budget (DEFAULT_CPU_KV_BYTES) so that several engines fit in one process."""

from __future__ import annotations

import torch

from adapters.slots import SlotPool
from adapters.types import BaseModelShapes
from base_engine.engine_config import DEFAULT_CPU_KV_BYTES, EngineConfig
from base_engine.model.config import ModelConfig
from base_engine.runner.model_runner import kv_bytes_per_block

GIB = 1 << 30


def plan_memory(
    config: ModelConfig, engine: EngineConfig, *, dtype: torch.dtype, device: torch.device
) -> int:
    """Number of KV blocks; on CUDA measured once, after the weights and before any pool is allocated."""
    if device.type != "cuda":
        return num_kv_blocks(config, engine, dtype=dtype, free_bytes=None)
    free, _total = torch.cuda.mem_get_info(device)
    reserved = slot_bytes(config.base_shapes(), engine, dtype=dtype, free_bytes=free)
    return num_kv_blocks(config, engine, dtype=dtype, free_bytes=free - reserved)


def slot_bytes(base: BaseModelShapes, engine: EngineConfig, *, dtype: torch.dtype, free_bytes: int) -> int:
    """Bytes of `max_loras` adapter slots; raises naming the figures when they do not fit
    `lora_memory_fraction` of the free memory (never silently fewer slots than configured)."""
    per_slot = SlotPool.bytes_per_slot(base, engine.max_lora_rank, dtype)
    budget = int(free_bytes * engine.lora_memory_fraction)
    need = engine.max_loras * per_slot
    if need > budget:
        raise ValueError(
            f"max_loras={engine.max_loras} adapter slots at max_lora_rank={engine.max_lora_rank} need "
            f"{need / GIB:.2f} GiB ({per_slot / GIB:.3f} GiB each), but lora_memory_fraction="
            f"{engine.lora_memory_fraction} of {free_bytes / GIB:.2f} GiB free allows {budget / GIB:.2f} GiB "
            f"({budget // per_slot} slots); lower max_loras or max_lora_rank, or raise lora_memory_fraction"
        )
    return need


def num_kv_blocks(
    config: ModelConfig, engine: EngineConfig, *, dtype: torch.dtype, free_bytes: int | None
) -> int:
    """`free_bytes`: device memory left for the KV pool (None on CPU: the fixed budget)."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    per_block = kv_bytes_per_block(config, engine.block_size, dtype)
    budget = DEFAULT_CPU_KV_BYTES if free_bytes is None else int(free_bytes * engine.kv_cache_memory_fraction)
    num = budget // per_block
    if num < 1:
        raise ValueError(f"KV cache budget {budget} bytes holds no block of {per_block} bytes")
    return int(num)
