"""`--dtype auto` on the CPU (base_engine/runner/device.py): bfloat16 where the CPU has native bf16
matmuls (AMX-BF16 or AVX512-BF16 in /proc/cpuinfo flags), float32 otherwise, logged with the reason."""

from __future__ import annotations

import logging

import torch

from base_engine.model.config import load_model_config
from base_engine.runner.device import auto_cpu_dtype, resolve_dtype
from base_engine.runner.host import read_cpu_flags


def test_auto_is_bfloat16_only_with_native_bf16_instructions() -> None:
    amx = frozenset({"avx2", "amx_bf16", "amx_tile"})
    assert auto_cpu_dtype(amx) == (torch.bfloat16, "the CPU has amx_bf16")
    dtype, reason = auto_cpu_dtype(frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert dtype == torch.bfloat16 and reason == "the CPU has amx_bf16 and avx512_bf16"
    dtype, reason = auto_cpu_dtype(frozenset({"avx2", "avx512f"}))
    assert dtype == torch.float32 and "none of amx_bf16, avx512_bf16" in reason
    assert auto_cpu_dtype(frozenset())[0] == torch.float32


def test_resolve_auto_on_this_cpu_logs_the_choice(tiny_llama_dir, caplog) -> None:
    config = load_model_config(tiny_llama_dir)
    with caplog.at_level(logging.INFO, logger="base_engine.runner.device"):
        dtype = resolve_dtype("auto", config, torch.device("cpu"))
    assert dtype == auto_cpu_dtype(read_cpu_flags())[0]
    assert f"dtype auto -> {str(dtype).removeprefix('torch.')}: the CPU has" in caplog.text
    assert resolve_dtype("float32", config, torch.device("cpu")) == torch.float32
