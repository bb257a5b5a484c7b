"""Gemma 2 / Gemma 3 config.json files parse as transformers reads them (defaults, layer types, the two
RoPE settings, soft-caps, the nested text config of Gemma3ForConditionalGeneration), and what the
engine would not honour is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from base_engine.model.config import ModelConfig, load_model_config
from tests.base_engine.published_configs import write_config

# As published on the Hugging Face hub (google/gemma-3-270m, google/gemma-2-2b, google/gemma-3-4b-it).
GEMMA3_270M: dict[str, Any] = {
    "_sliding_window_pattern": 6,
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "torch_dtype": "bfloat16",
    "use_bidirectional_attention": False,
    "use_cache": True,
    "vocab_size": 262144,
}
GEMMA2_2B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 256000,
}
# Published with most text fields left to Gemma3TextConfig's defaults.
GEMMA3_4B_IT: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def _assert_like_transformers(config: ModelConfig, model_dir: Path) -> None:
    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = hf.get_text_config()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
        assert getattr(config, name) == getattr(text, name), name
    assert (config.num_attention_heads, config.num_key_value_heads) == (
        text.num_attention_heads,
        text.num_key_value_heads,
    )
    assert config.max_position_embeddings == text.max_position_embeddings
    assert config.query_pre_attn_scalar == text.query_pre_attn_scalar
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    windows = tuple(text.sliding_window if t == "sliding_attention" else None for t in text.layer_types)
    assert config.layer_windows == windows
    ropes = text.rope_parameters
    if "full_attention" in ropes:  # Gemma 3: one RoPE per layer type
        glob, local = ropes["full_attention"], ropes["sliding_attention"]
        assert (config.local_rope.theta, config.local_rope.rope_type) == (
            local["rope_theta"],
            local["rope_type"],
        )
    else:
        glob = ropes
        assert config.local_rope is None
    assert (config.rope.theta, config.rope.rope_type) == (glob["rope_theta"], glob["rope_type"])
    assert config.rope.factor == glob.get("factor", 1.0)


def test_gemma3_270m(tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, GEMMA3_270M))
    _assert_like_transformers(config, tmp_path)
    assert config.layer_windows[5::6] == (None, None, None) and config.layer_windows[0] == 512
    assert (config.rope.theta, config.local_rope.theta) == (1e6, 1e4)
    assert config.qk_norm and config.gemma_layout and config.hidden_act == "gelu_pytorch_tanh"
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    assert not config.has_vision_tower


def test_gemma3_pattern_without_layer_types(tmp_path: Path) -> None:
    raw = {k: v for k, v in GEMMA3_270M.items() if k not in ("layer_types", "_sliding_window_pattern")}
    config = load_model_config(write_config(tmp_path, {**raw, "sliding_window_pattern": 3}))
    _assert_like_transformers(config, tmp_path)
    assert config.layer_windows[:3] == (512, 512, None)


def test_gemma3_multimodal_text_config_with_defaults(tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, GEMMA3_4B_IT))
    _assert_like_transformers(config, tmp_path)
    assert config.has_vision_tower and config.architecture == "Gemma3ForConditionalGeneration"
    assert (config.rope.rope_type, config.rope.factor) == ("linear", 8.0)
    assert config.local_rope.rope_type == "default" and config.eos_token_ids == (1, 106)


def test_gemma2_2b(tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, GEMMA2_2B))
    _assert_like_transformers(config, tmp_path)
    assert config.layer_windows[:2] == (4096, None)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert not config.qk_norm and config.eos_token_ids == (1, 107)


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    """What transformers 5 writes: one rope object per layer type."""
    raw = {
        k: v
        for k, v in GEMMA3_270M.items()
        if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")
    }
    raw["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    config = load_model_config(write_config(tmp_path, raw))
    _assert_like_transformers(config, tmp_path)
    assert (config.rope.factor, config.local_rope.factor) == (4.0, 1.0)


@pytest.mark.parametrize(
    ("base", "change", "named"),
    [
        (GEMMA3_270M, {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (GEMMA3_270M, {"hidden_activation": "gelu"}, "hidden_activation"),
        (GEMMA3_270M, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (GEMMA3_270M, {"layer_types": ["chunked_attention"] * 18}, "chunked_attention"),
        (GEMMA3_270M, {"layer_types": ["full_attention"] * 3}, "layer_types"),
        (GEMMA3_270M, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        (GEMMA3_270M, {"sliding_window": None}, "sliding_window"),
        (GEMMA3_270M, {"query_pre_attn_scalar": None}, "query_pre_attn_scalar"),
        (GEMMA2_2B, {"hidden_activation": "silu"}, "hidden_activation"),
        (GEMMA2_2B, {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        (
            GEMMA3_4B_IT,
            {"text_config": {**GEMMA3_4B_IT["text_config"], "final_logit_softcapping": 30.0}},
            "final_logit_softcapping",
        ),
    ],
)
def test_refusals_name_the_field(tmp_path: Path, base: dict, change: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named) as info:
        load_model_config(write_config(tmp_path, {**base, **change}))
    assert "config.json" in str(info.value)
