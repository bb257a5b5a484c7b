"""Tiny random-weight Hugging Face checkpoints and a locally trained tokenizer, for tests and demos.

The checkpoint is what `transformers` `save_pretrained(safe_serialization=True)` writes for
LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Phi3ForCausalLM /
Gemma2ForCausalLM / Gemma3ForCausalLM, and Gemma3ForConditionalGeneration with a tiny SigLIP vision
tower ("gemma3-vision")
(config.json, model.safetensors, generation_config.json), plus a byte-level BPE tokenizer (GPT-2 /
Llama-3 style byte-level pre-tokenizer) with Llama-3's special tokens and chat template format, so the
engine loads it exactly as it would load a published checkpoint. Nothing is downloaded.

The tokenizer is built by tiny_tokenizer.py and its chat formats come from tiny_chat_formats.py.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from base_engine.testing.chat_formats import END_OF_TEXT_TOKEN
from base_engine.testing.moe_layout import fuse_experts
from base_engine.testing.tokenizer import build_tokenizer

_ARCHS: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "gemma3-vision": (Gemma3Config, Gemma3ForConditionalGeneration),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
}
# The smallest SigLIP tower Gemma3ForConditionalGeneration builds: 28 px images of 2 x 2 patches,
# pooled to mm_tokens_per_image = 4.
_TINY_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}


def _randomize_(model: PreTrainedModel, init_scale: float) -> None:
    """Re-draw every parameter so that forgetting to load any of them changes outputs.

    transformers initialises norms to 1 and biases to 0; an engine that skipped loading them would
    still match. Norm weights become 1 + noise and biases small noise. Matrices get std
    init_scale / sqrt(fan_in): each projection then keeps activations at a similar size whatever the
    hidden size, logits have std ~init_scale, so top-1 gaps sit far above float noise and greedy
    decoding does not collapse into repeating one token (it does with std 0.02).
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.05)
            else:
                param.normal_(0.0, init_scale / math.sqrt(param.shape[-1]))


def _build_config(arch: str, overrides: dict[str, Any]) -> PreTrainedConfig:
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCHS)}")
    config_cls, _ = _ARCHS[arch]
    if arch == "mistral":
        # Mistral defaults to a 4096 window; none means full attention, which every engine can serve.
        overrides.setdefault("sliding_window", None)
    if arch == "gemma3-vision":
        top = {
            k: overrides[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in overrides
        }
        text = Gemma3TextConfig(**overrides)
        return config_cls(text_config=text, vision_config=_TINY_VISION, mm_tokens_per_image=4, **top)
    if arch == "phi3":
        overrides.setdefault("pad_token_id", None)  # Phi3Config's 32000 lies outside a tiny vocabulary
    return config_cls(**overrides)


def save_random_checkpoint(
    path: Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    chat_format: str = "llama3",
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 2048,
    init_scale: float = 1.6,
    expert_layout: str = "per_expert",
    **config_overrides: Any,
) -> Path:
    """Write a random-weight HF checkpoint (safetensors + tokenizer + generation config) to `path`.

    `config_overrides` go to the transformers config (e.g. `head_dim`, `rope_parameters`,
    `attention_bias`, `sliding_window`); `init_scale` sets the weights' size (see `_randomize_`).
    MoE archs: `expert_layout` "per_expert" (what save_pretrained writes) or "fused" (3-D expert tensors).
    Same arguments, same weights. Returns `path`.
    """
    path = Path(path)
    tokenizer = build_tokenizer(min(vocab_size, 512), chat_format)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"model vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
    bos_id = tokenizer.bos_token_id
    eot_id = tokenizer.eos_token_id
    end_of_text_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT_TOKEN)
    fields: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        # config.json carries the base-model eos (like Llama-3 base); generation_config.json the list.
        "bos_token_id": bos_id,
        "eos_token_id": end_of_text_id,
        **config_overrides,
    }
    config = _build_config(arch, copy.deepcopy(fields))  # transformers edits nested dicts (rope_scaling)
    _, model_cls = _ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize_(model, init_scale)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=[eot_id, end_of_text_id])
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if expert_layout == "fused":
        fuse_experts(path)
    tokenizer.save_pretrained(path)
    return path
