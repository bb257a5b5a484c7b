"""Tiny PEFT LoRA adapters for tests, built with `peft` itself, and PEFT's own deltas as the oracle.

`save_peft_adapter` wraps a tiny random transformers model with `peft.get_peft_model` and saves it
with `save_pretrained`; `peft_deltas` loads a directory back with `PeftModel.from_pretrained` on a
fresh base model and returns `get_delta_weight` per LoRA layer in float64, so hand-edited configs are
judged by PEFT's own reading of them. Edit helpers rewrite a saved adapter in place.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from adapters.types import BaseModelShapes

# LlamaConfig-style sizes shared by the three architectures (hidden 64, 2 layers, 4 heads, 2 KV heads).
TINY_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 128,
}


def tiny_model(model_type: str = "llama", *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random *ForCausalLM of `model_type` ("llama" | "mistral" | "qwen2" | "qwen3" | "phi3") with
    TINY_SIZES."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    if model_type == "phi3":
        overrides = {"pad_token_id": None} | overrides  # Phi3Config's 32000 lies outside TINY_SIZES' vocab
    torch.manual_seed(seed)
    return model_cls(config_cls(**(TINY_SIZES | overrides))).eval()


def base_shapes(model: torch.nn.Module) -> BaseModelShapes:
    """BaseModelShapes read from a transformers model's config."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return BaseModelShapes(
        model_type=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
    )


def tiny_shapes(model_type: str = "llama", **overrides: int) -> BaseModelShapes:
    """The BaseModelShapes of `tiny_model(model_type)` without building it."""
    sizes = TINY_SIZES | overrides
    return BaseModelShapes(
        model_type=model_type,
        num_layers=sizes["num_hidden_layers"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_attention_heads=sizes["num_attention_heads"],
        num_key_value_heads=sizes["num_key_value_heads"],
        head_dim=sizes["hidden_size"] // sizes["num_attention_heads"],
        vocab_size=sizes["vocab_size"],
    )


def save_peft_adapter(
    out_dir: Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **lora_kwargs: Any,
) -> Path:
    """Build LoraConfig(init_lora_weights=False, **lora_kwargs) on a tiny model and save it to out_dir."""
    from peft import LoraConfig, get_peft_model

    lora_kwargs.setdefault("init_lora_weights", False)
    model = tiny_model(model_type, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns about fan_in_fan_out on nn.Linear, etc.
        torch.manual_seed(seed + 1)
        peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
        if dtype is not None:
            peft_model.to(dtype)
        peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_deltas(adapter_dir: Path, model_type: str = "llama") -> dict[tuple[int, str], torch.Tensor]:
    """PEFT's delta_W = scale * B @ A per (layer, projection) in float64, via PeftModel.from_pretrained."""
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(tiny_model(model_type), str(adapter_dir)).double()
    deltas: dict[tuple[int, str], torch.Tensor] = {}
    for name, module in model.named_modules():
        # a ParamWrapper on a 2-D weight (target_parameters) is LoRA on its module
        if isinstance(module, (LoraLinear, ParamWrapper)) and "default" in module.lora_A:
            found = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$", name)
            assert found is not None, name
            deltas[(int(found.group(1)), found.group(2))] = module.get_delta_weight("default").detach()
    return deltas


def edit_config(adapter_dir: Path, **changes: Any) -> dict[str, Any]:
    """Set (or, with value ...  Ellipsis, delete) keys of adapter_config.json; returns the new config."""
    path = Path(adapter_dir) / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is Ellipsis:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return config


def edit_tensors(
    adapter_dir: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    """Rewrite adapter_model.safetensors with `edit(tensors)`."""
    path = Path(adapter_dir) / "adapter_model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})
