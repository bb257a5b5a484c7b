"""A read-only description of a running engine: what an answer's provenance names.

Built from the engine's public attributes and config only; it changes nothing and is read once at
start-up. Two answers can only be expected to be bitwise equal when every field here is equal (and
the weights and the build are the same): the kernels' reduction orders depend on the dtype, the
device and its SIMD level or GPU model, and on which LoRA and attention kernels run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from base_engine.engine import LLMEngine

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu" | "cuda:0"
    device_name: str  # "NVIDIA H200" | "AMD EPYC 7B13 (AVX2)"
    lora_kernel: str  # kernels/sgmv backend: "triton" on CUDA, else "torch" (its PyTorch twin)
    attention: str  # "paged-triton" | "paged-torch" (kernels/attention) | "buckets-sdpa" (CPU default)
    torch_version: str


def describe_engine(engine: LLMEngine) -> EngineIdentity:
    """The identity of `engine` as it was built (device, dtype, runner's attention path)."""
    device = engine.device
    is_cuda = device.type == "cuda"
    # Both kernel families choose "auto" = Triton for CUDA tensors, the PyTorch twin otherwise
    # (kernels/sgmv/api.py, kernels/attention/api.py), and the engine always asks for "auto".
    kernel = "triton" if is_cuda else "torch"
    attention = f"paged-{kernel}" if engine.runner.use_paged else "buckets-sdpa"
    return EngineIdentity(
        dtype=_DTYPE_NAMES.get(engine.dtype, str(engine.dtype).removeprefix("torch.")),
        device=f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
        if is_cuda
        else device.type,
        device_name=_device_name(device),
        lora_kernel=kernel,
        attention=attention,
        torch_version=torch.__version__,
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    return f"{_cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux); "unknown" elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return "unknown"
