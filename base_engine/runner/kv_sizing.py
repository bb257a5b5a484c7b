"""Device memory plan: adapter slots first (the configured number, or a refusal with the figures),
then the KV pool: an explicit count, an explicit size (`kv_cache_bytes`), or a fraction of the memory
left: on CUDA the free device memory after the slots, on the CPU the host memory this process may
still use (runner/host.py: MemAvailable cut to the cgroup limit). On the CPU a pool sized from a
fraction stops at the blocks every sequence at full length needs (`max_num_seqs` x `max_model_len`):
more would only hold prefix-cache entries, and would take host memory from every other engine."""

from __future__ import annotations

import logging
import math

import torch

from adapters.slots import SlotPool
from adapters.types import BaseModelShapes
from base_engine.engine_config import DEFAULT_CPU_KV_FRACTION, DEFAULT_GPU_KV_FRACTION, EngineConfig
from base_engine.model.config import ModelConfig
from base_engine.runner.host import HostMemory, read_host_memory
from base_engine.runner.model_runner import kv_bytes_per_block

logger = logging.getLogger(__name__)

GIB = 1 << 30


def plan_memory(
    config: ModelConfig,
    engine: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Number of KV blocks; measured once, after the weights and before any pool is allocated (the CPU
    figures also serve the `meta` device's shape-only runs)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reserved = slot_bytes(config.base_shapes(), engine, dtype=dtype, free_bytes=free)
        return num_kv_blocks(config, engine, dtype=dtype, free_bytes=free - reserved)
    memory = read_host_memory()
    num, figures = cpu_kv_blocks(config, engine, dtype=dtype, memory=memory, max_model_len=max_model_len)
    logger.info("KV pool: %d blocks (%s)", num, figures)
    return num


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


def num_kv_blocks(config: ModelConfig, engine: EngineConfig, *, dtype: torch.dtype, free_bytes: int) -> int:
    """CUDA: `free_bytes` is the device memory left for the KV pool after the weights and slots."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    per_block = kv_bytes_per_block(config, engine.block_size, dtype)
    fraction = engine.kv_cache_memory_fraction or DEFAULT_GPU_KV_FRACTION
    budget = engine.kv_cache_bytes if engine.kv_cache_bytes is not None else int(free_bytes * fraction)
    return _blocks_in(budget, per_block)


def cpu_kv_blocks(
    config: ModelConfig,
    engine: EngineConfig,
    *,
    dtype: torch.dtype,
    memory: HostMemory,
    max_model_len: int,
) -> tuple[int, str]:
    """(blocks, the figures they were chosen from, for the start-up log) on the CPU."""
    per_block = kv_bytes_per_block(config, engine.block_size, dtype)
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks, f"num_kv_blocks; {per_block} bytes per block"
    if engine.kv_cache_bytes is not None:
        num = _blocks_in(engine.kv_cache_bytes, per_block)
        return num, f"kv_cache_bytes {engine.kv_cache_bytes / GIB:.2f} GiB / {per_block} bytes per block"
    fraction = engine.kv_cache_memory_fraction or DEFAULT_CPU_KV_FRACTION
    budget = int(memory.available_bytes * fraction)
    useful = engine.max_num_seqs * math.ceil(max_model_len / engine.block_size)
    num = min(_blocks_in(budget, per_block), useful)
    return num, (
        f"{num * per_block / GIB:.2f} GiB: fraction {fraction} of {memory.available_bytes / GIB:.2f} GiB "
        f"available (total {memory.total_bytes / GIB:.2f} GiB) = {budget / GIB:.2f} GiB, {per_block} bytes "
        f"per block, at most {useful} blocks = max_num_seqs {engine.max_num_seqs} x max_model_len "
        f"{max_model_len} / block_size {engine.block_size}"
    )


def _blocks_in(budget: int, per_block: int) -> int:
    num = budget // per_block
    if num < 1:
        raise ValueError(f"KV cache budget {budget} bytes holds no block of {per_block} bytes")
    return int(num)
