"""A norm applied with each row's adapter copy where one exists (PEFT `modules_to_save` on norms)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def normed(norm: nn.Module, x: torch.Tensor, lora: Any) -> torch.Tensor:
    """`norm(x)`, then the rows whose adapter saves its own copy of `norm` recomputed with it
    (`LoraBatch.apply_norm`; a no-op without such adapters)."""
    y = norm(x)
    if lora is not None:
        lora.apply_norm(norm, x, y)
    return y
