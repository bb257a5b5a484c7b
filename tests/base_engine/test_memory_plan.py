"""Device memory plan: the configured adapter slots are reserved before the KV pool is sized, or
start-up refuses with the figures (CUDA used to size slots from what the KV cache left: 3 of 4)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from adapters.slots import SlotPool
from adapters.types import BaseModelShapes
from base_engine.engine_config import EngineConfig
from base_engine.model.config import load_model_config
from base_engine.runner.host import HostMemory
from base_engine.runner.kv_sizing import GIB, cpu_kv_blocks, num_kv_blocks, slot_bytes
from base_engine.runner.model_runner import kv_bytes_per_block
from base_engine.runner.weight_sizing import check_model_fits, check_weights_fit, model_weight_bytes
from tests.harness.families import CHECKPOINTS

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


def _checkpoint_bytes(model_dir) -> tuple[int, int]:
    """(all tensors, expert tensors) of a float32 safetensors checkpoint."""
    from safetensors import safe_open

    total = experts = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                size = f.get_slice(name).get_shape()
                num = math.prod(size) * 4
                total += num
                experts += num if ".experts." in name else 0
    return total, experts


@pytest.mark.parametrize(
    "variant", ["llama-gqa", "llama-tied", "qwen3-moe", "qwen3-moe-fused", "mixtral-window", "qwen2-moe"]
)
def test_weight_bytes_are_the_checkpoints_experts_included(variant: str, make_checkpoint) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS[variant])
    config = load_model_config(model_dir)
    weights = model_weight_bytes(config, torch.float32)
    assert (weights.total, weights.experts) == _checkpoint_bytes(model_dir)
    assert (weights.experts > 0) == (config.moe is not None)
    assert model_weight_bytes(config, torch.bfloat16).total == weights.total // 2
    head = config.vocab_size * config.hidden_size * 4  # the CPU's fp32 logits head for 16-bit weights
    assert model_weight_bytes(config, torch.bfloat16, float32_head=True).total == weights.total // 2 + head


def test_a_model_that_does_not_fit_is_refused_with_the_figures(make_checkpoint) -> None:
    config = load_model_config(make_checkpoint(**CHECKPOINTS["qwen3-moe"]))
    need = model_weight_bytes(config, torch.float32)
    fits = check_weights_fit(config, torch.float32, available_bytes=need.total, where="free")
    assert fits.total == need.total
    message = (
        r"does not fit: .* MiB of weights in float32, .* MiB of them routed experts "
        r"\(8 experts x 2 sparse layers\) need more than the 0\.10 MiB free"
    )
    with pytest.raises(ValueError, match=message):
        check_weights_fit(config, torch.float32, available_bytes=100 * 1024 + 400, where="free")
    assert check_model_fits(config, torch.float32, torch.device("cpu")).total == need.total  # fits this host


def test_published_moe_sizes(tmp_path) -> None:
    """Qwen3-30B-A3B: 30.5 B parameters (its model card), 128 experts x 48 layers; 61 GB in bf16 does not
    fit one 40 GiB GPU, and the refusal says why."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    config = load_model_config(tmp_path)
    weights = model_weight_bytes(config, torch.bfloat16)
    assert 30.4e9 < weights.total / 2 < 30.6e9 and weights.experts / weights.total > 0.94
    message = (
        r"56\.\d\d GiB of weights in bfloat16, 54\.\d\d GiB of them routed experts "
        r"\(128 experts x 48 sparse layers\) need more than the 40\.00 GiB"
    )
    with pytest.raises(ValueError, match=message):
        check_weights_fit(config, torch.bfloat16, available_bytes=40 * GIB, where="free on cuda:0")


QWEN3_30B_A3B = {  # the published config.json's shape fields
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}  # fmt: skip
