"""How many KV blocks the pool gets: an explicit count, a fraction of free device memory, or on CPU a
fixed budget (DEFAULT_CPU_KV_BYTES) so that several engines fit in one process."""

from __future__ import annotations

import torch

from base_engine.config import ModelConfig
from base_engine.engine_config import DEFAULT_CPU_KV_BYTES, EngineConfig
from base_engine.model_runner import kv_bytes_per_block


def num_kv_blocks(
    config: ModelConfig, engine: EngineConfig, *, dtype: torch.dtype, device: torch.device
) -> int:
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    per_block = kv_bytes_per_block(config, engine.block_size, dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * engine.kv_cache_memory_fraction)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    num = budget // per_block
    if num < 1:
        raise ValueError(f"KV cache budget {budget} bytes holds no block of {per_block} bytes")
    return int(num)
