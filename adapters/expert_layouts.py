"""The module names of an MoE layer in the two layouts an adapter may have been saved against:
transformers 5 fuses each layer's experts into 3-D tensors (`mlp.experts.gate_up_proj`, `down_proj`;
the router `mlp.gate` holds a bare parameter), transformers 4 built one SwiGLU MLP of nn.Linear per
expert (`mlp.experts.N.gate_proj` ..., Mixtral `block_sparse_moe.experts.N.w1/w3/w2`) and the router as
an nn.Linear. adapters/peft_targets.py resolves targets against either; adapters/experts_v4.py serves
the per-expert one on the fused tensors."""

from __future__ import annotations

import re

import torch

from adapters.types import BaseModelShapes

FUSED = "fused"  # transformers 5 expert tensors (adapters/experts.py)
PER_EXPERT = "per_expert"  # transformers 4 per-expert modules (this module)

# Mixtral's transformers-4 names of the SwiGLU parts.
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PER_EXPERT_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.\w+\.lora_[AB].*"
)
PER_EXPERT_MODULE = re.compile(r"experts\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)")


def expert_layout(tensors: dict[str, torch.Tensor]) -> str:
    """PER_EXPERT when any tensor is LoRA on one expert's module (an adapter saved on transformers 4)."""
    return PER_EXPERT if any(_PER_EXPERT_TENSOR.fullmatch(name) for name in tensors) else FUSED


def block_name(base: BaseModelShapes) -> str:
    return "block_sparse_moe" if base.model_type == "mixtral" else "mlp"


def _parts(base: BaseModelShapes) -> tuple[str, ...]:
    return ("w1", "w2", "w3") if base.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def per_expert_module_keys(base: BaseModelShapes, layer: int) -> list[str]:
    """A sparse layer's MoE modules in transformers 4 (router and experts; not the shared expert)."""
    block = f"model.layers.{layer}.{block_name(base)}"
    assert base.moe is not None
    keys = [block, f"{block}.gate", f"{block}.experts"]
    for e in range(base.moe.num_experts):
        keys += [f"{block}.experts.{e}"] + [f"{block}.experts.{e}.{p}" for p in (*_parts(base), "act_fn")]
    return keys


def per_expert_linear_keys(base: BaseModelShapes, layer: int) -> list[str]:
    """What "all-linear" selects in a sparse layer on transformers 4: the router and every expert part."""
    block = f"model.layers.{layer}.{block_name(base)}"
    assert base.moe is not None
    return [f"{block}.gate"] + [
        f"{block}.experts.{e}.{p}" for e in range(base.moe.num_experts) for p in _parts(base)
    ]


def per_expert_target(key: str) -> tuple[int, str] | None:
    """(layer, "experts.N.<gate_proj|up_proj|down_proj>") for a transformers-4 expert module key; the
    router key gives (layer, "router"); None for any other key."""
    found = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)", key)
    if found is not None:
        part = _MIXTRAL_PARTS.get(found.group(3), found.group(3))
        if part not in ("gate_proj", "up_proj", "down_proj"):
            return None
        return int(found.group(1)), f"experts.{found.group(2)}.{part}"
    router = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate", key)
    return (int(router.group(1)), "router") if router is not None else None


def is_per_expert(module: str) -> bool:
    return PER_EXPERT_MODULE.fullmatch(module) is not None
