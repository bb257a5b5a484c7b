"""LoRA adapters written directly in PEFT's on-disk format for a tiny Llama's shapes (no `peft` needed):
`base_model.model.<module>.lora_A.weight` [r, in], `lora_B.weight` [out, r], plus adapter_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapters.types import BaseModelShapes

SHAPES = BaseModelShapes(
    model_type="llama",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
)
BASE_MODEL = "tiny-llama"


def write_adapter(
    directory: Path, *, rank: int = 4, seed: int = 0, modules: tuple[str, ...] = ("q_proj", "v_proj")
) -> Path:
    """A valid LoRA adapter for SHAPES in `directory` (distinct bytes per seed)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(SHAPES.num_layers):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = SHAPES.module_shape(module)
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(modules),
        "base_model_name_or_path": BASE_MODEL,
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
