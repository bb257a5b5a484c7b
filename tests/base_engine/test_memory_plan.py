"""Device memory plan: the configured adapter slots are reserved before the KV pool is sized, or
start-up refuses with the figures (CUDA used to size slots from what the KV cache left: 3 of 4)."""

from __future__ import annotations

import pytest
import torch

from adapters.slots import SlotPool
from adapters.types import BaseModelShapes
from base_engine.engine_config import EngineConfig
from base_engine.model.config import load_model_config
from base_engine.runner.host import HostMemory
from base_engine.runner.kv_sizing import GIB, cpu_kv_blocks, num_kv_blocks, slot_bytes
from base_engine.runner.model_runner import kv_bytes_per_block

LLAMA3_8B = BaseModelShapes(
    model_type="llama", num_layers=32, hidden_size=4096, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
)  # fmt: skip


def test_configured_slots_fit_or_start_up_refuses_with_figures() -> None:
    engine = EngineConfig(max_loras=4, max_lora_rank=64, lora_memory_fraction=0.1)
    per_slot = SlotPool.bytes_per_slot(LLAMA3_8B, 64, torch.bfloat16)  # bf16 factors + fp32 DoRA scales
    assert per_slot == 32 * (81920 * 64 * 2 + 43008 * 4)
    assert slot_bytes(LLAMA3_8B, engine, dtype=torch.bfloat16, free_bytes=40 * GIB) == 4 * per_slot
    with pytest.raises(ValueError, match=r"max_loras=4 .* need 1\.27 GiB .* allows 1\.00 GiB \(3 slots\)"):
        slot_bytes(LLAMA3_8B, engine, dtype=torch.bfloat16, free_bytes=10 * GIB)


def test_kv_pool_gets_the_memory_left_after_the_slots(tiny_llama_dir) -> None:
    config = load_model_config(tiny_llama_dir)
    engine = EngineConfig(block_size=16, kv_cache_memory_fraction=0.5)
    per_block = kv_bytes_per_block(config, 16, torch.float32)
    free, reserved = 1000 * per_block, 200 * per_block
    assert num_kv_blocks(config, engine, dtype=torch.float32, free_bytes=free - reserved) == 400
    assert num_kv_blocks(config, EngineConfig(num_kv_blocks=7), dtype=torch.float32, free_bytes=free) == 7


def test_cpu_kv_pool_is_a_fraction_of_available_memory_capped_at_full_residency(tiny_llama_dir) -> None:
    config = load_model_config(tiny_llama_dir)
    per_block = kv_bytes_per_block(config, 16, torch.bfloat16)
    memory = HostMemory(total_bytes=10_000 * per_block, available_bytes=1000 * per_block)
    engine = EngineConfig(block_size=16, kv_cache_memory_fraction=0.5, max_num_seqs=64)
    num, figures = cpu_kv_blocks(config, engine, dtype=torch.bfloat16, memory=memory, max_model_len=4096)
    assert num == 500  # 0.5 of the available memory, not 1 GiB and not the total
    for figure in ("fraction 0.5", f"{per_block} bytes per block", "available", "total"):
        assert figure in figures
    default = EngineConfig(block_size=16)  # the CPU default fraction
    assert cpu_kv_blocks(config, default, dtype=torch.bfloat16, memory=memory, max_model_len=4096)[0] == 300
    # Never more than every sequence at full length needs: 2 seqs x 64 tokens / 16 = 8 blocks.
    small = EngineConfig(block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    assert cpu_kv_blocks(config, small, dtype=torch.bfloat16, memory=memory, max_model_len=64)[0] == 8
    # bfloat16 blocks are half the float32 ones: twice as many fit.
    assert cpu_kv_blocks(config, engine, dtype=torch.float32, memory=memory, max_model_len=4096)[0] == 250


def test_cpu_kv_pool_of_an_explicit_size_or_count(tiny_llama_dir) -> None:
    config = load_model_config(tiny_llama_dir)
    per_block = kv_bytes_per_block(config, 16, torch.float32)
    memory = HostMemory(total_bytes=GIB, available_bytes=GIB)
    sized = EngineConfig(block_size=16, kv_cache_bytes=37 * per_block + 5)
    num, figures = cpu_kv_blocks(config, sized, dtype=torch.float32, memory=memory, max_model_len=4096)
    assert num == 37 and "kv_cache_bytes" in figures
    counted = EngineConfig(num_kv_blocks=7)
    assert cpu_kv_blocks(config, counted, dtype=torch.float32, memory=memory, max_model_len=64)[0] == 7
    with pytest.raises(ValueError, match=r"KV cache budget 3 bytes holds no block"):
        tiny = EngineConfig(kv_cache_bytes=3)
        cpu_kv_blocks(config, tiny, dtype=torch.float32, memory=memory, max_model_len=64)
    with pytest.raises(ValueError, match="kv_cache_bytes must be >= 1"):
        EngineConfig(kv_cache_bytes=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused_clearly(tiny_llama_dir) -> None:
    from base_engine.engine import LLMEngine

    with pytest.raises(ValueError, match=r"CUDA is not available here .* serve with --device cpu"):
        LLMEngine(tiny_llama_dir, device="cuda", dtype="bfloat16")
    with pytest.raises(ValueError, match="not supported"):
        LLMEngine(tiny_llama_dir, device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_serve_with_cuda_refuses_before_starting(tiny_llama_dir, tmp_path) -> None:
    import os
    import subprocess
    import sys

    code = "from api.cli.main import main; main()"
    cmd = [sys.executable, "-c", code, "serve", "--model", str(tiny_llama_dir), "--data-dir", str(tmp_path),
           "--device", "cuda", "--dtype", "bfloat16", "--port", "1"]  # fmt: skip
    env = {**os.environ, "COLUMNS": "400"}  # one line, so the message is not wrapped
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "CUDA is not available" in done.stderr, done.stderr[-2000:]
