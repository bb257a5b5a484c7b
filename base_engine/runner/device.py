"""The device and dtype an engine serves on, checked before anything is loaded.

`LLMEngine` resolves both first; the CLI calls `check_device` before it starts a server, so a missing
CUDA device is refused with why, not found out after the model has loaded.
"""

from __future__ import annotations

import logging

import torch

from base_engine.model.config import ModelConfig
from base_engine.runner.host import read_cpu_flags

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /proc/cpuinfo flags of a CPU with bfloat16 matmul instructions (AMX tiles, or AVX-512 dot products):
# oneDNN then runs bf16 GEMMs at about twice the float32 rate; without them bf16 is emulated, slower.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def auto_cpu_dtype(flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """`--dtype auto` on the CPU, with the reason: bfloat16 where the CPU computes it natively."""
    native = [flag for flag in CPU_BF16_FLAGS if flag in flags]
    if native:
        return torch.bfloat16, f"the CPU has {' and '.join(native)}"
    return torch.float32, f"the CPU has none of {', '.join(CPU_BF16_FLAGS)} (bfloat16 would be emulated)"


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The serving dtype; "auto" is the checkpoint's dtype on CUDA and `auto_cpu_dtype` on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type != "cpu":
            resolved, reason = config.dtype, "the checkpoint's dtype"
        else:
            resolved, reason = auto_cpu_dtype(read_cpu_flags())
        logger.info("dtype auto -> %s: %s", str(resolved).removeprefix("torch."), reason)
        return resolved
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def check_device(device: str | torch.device) -> torch.device:
    """The device to serve on; a CUDA device on a machine without one is refused, naming why."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in (
        "cpu",
        "cuda",
        "meta",
    ):  # meta: shape-only runs (the device guard test)
        raise ValueError(f"device {str(device)!r} is not supported; expected 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r} was asked for, but CUDA is not available here (torch "
                f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); serve with --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev
