"""The device and dtype an engine serves on, checked before anything is loaded.

`LLMEngine` resolves both first; the CLI calls `check_device` before it starts a server, so a missing
CUDA device is refused with why, not found out after the model has loaded.
"""

from __future__ import annotations

import torch

from base_engine.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return config.dtype
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
