"""Random-weight LoRA adapters written in PEFT's on-disk format (demo tenants and benchmarks).

The files are exactly what `peft`'s `save_pretrained` writes for a LoRA on the given projections
(`adapter_config.json` + `adapter_model.safetensors`), so they exercise the same loading path as a
real upload without needing `peft` installed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapters.types import LORA_MODULES, BaseModelShapes

_PARENT = {m: "self_attn" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")} | {
    m: "mlp" for m in ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
}


def save_random_adapter(
    path: Path,
    base: BaseModelShapes,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    modules: Sequence[str] = LORA_MODULES,
    seed: int = 0,
    std: float = 0.05,
    base_model_name: str = "",
    dora: bool = False,
) -> Path:
    """With `dora`, a DoRA adapter: also a `lora_magnitude_vector` [out] per module, in [0.5, 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(base.num_layers):
        for module in modules:
            in_features, out_features = base.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * std
            if dora:
                tensors[f"{prefix}.lora_magnitude_vector"] = torch.rand(out_features, generator=gen) + 0.5
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": dora,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "adapter_model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
