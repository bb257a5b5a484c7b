"""config.json parsing: tiny checkpoints written by transformers and published configs, checked against
transformers' own AutoConfig and against the tensors actually stored in the checkpoint. Single fields
(RoPE forms, eos ids, dtypes, refusals) are in test_config_fields.py."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from adapters.types import LORA_MODULES
from base_engine.model.config import load_model_config
from tests.base_engine.published_configs import (
    LLAMA31_8B,
    LLAMA31_8B_INSTRUCT_GENERATION,
    MISTRAL_7B_V01,
    QWEN2_7B,
    QWEN3_0_6B,
    assert_matches_transformers,
    write_config,
)


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_dir", "tiny_mistral_dir", "tiny_qwen2_dir", "tiny_llama_tied_dir"]
)
def test_tiny_checkpoints_parse_like_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    config = load_model_config(model_dir)
    assert_matches_transformers(config, model_dir)
    assert config.architecture == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    assert config.dtype == torch.float32
    assert config.tie_word_embeddings == (fixture == "tiny_llama_tied_dir")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "llama"},
        {"arch": "llama", "attention_bias": True, "mlp_bias": True},
        {"arch": "mistral"},
        {"arch": "qwen2"},
        {"arch": "llama", "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 1},
        {"arch": "qwen3", "head_dim": 32},
        {"arch": "qwen3", "head_dim": 32, "attention_bias": True},
    ],
    ids=["llama", "llama-bias", "mistral", "qwen2", "llama-head_dim-mqa", "qwen3", "qwen3-bias"],
)
def test_biases_and_shapes_match_the_stored_tensors(
    kwargs: dict[str, Any], make_checkpoint: Callable[..., Path]
) -> None:
    """Oracle: the tensors transformers wrote. Bias flags and every projection's shape must agree."""
    model_dir = make_checkpoint(**kwargs)
    config = load_model_config(model_dir)
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    attn = "model.layers.0.self_attn"
    assert config.attention_bias == (f"{attn}.q_proj.bias" in names) == (f"{attn}.v_proj.bias" in names)
    assert config.o_proj_bias == (f"{attn}.o_proj.bias" in names)
    assert config.mlp_bias == ("model.layers.0.mlp.up_proj.bias" in names)
    assert config.qk_norm == (f"{attn}.q_norm.weight" in names) == (f"{attn}.k_norm.weight" in names)
    shapes_for_adapters = config.base_shapes()
    for module in LORA_MODULES:
        prefix = attn if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "model.layers.0.mlp"
        out_features, in_features = shapes[f"{prefix}.{module}.weight"]
        assert shapes_for_adapters.module_shape(module) == (in_features, out_features)
    assert shapes_for_adapters.num_layers == config.num_hidden_layers
    assert shapes_for_adapters.vocab_size == shapes["model.embed_tokens.weight"][0]


def test_bfloat16_checkpoint_dtype(make_checkpoint: Callable[..., Path]) -> None:
    assert load_model_config(make_checkpoint(dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_llama31_8b(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path, LLAMA31_8B, LLAMA31_8B_INSTRUCT_GENERATION)
    config = load_model_config(model_dir)
    assert_matches_transformers(config, model_dir)
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (128, 8, 128256)
    rope = config.rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)
    assert (rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (
        1.0,
        4.0,
        8192,
    )
    assert config.eos_token_ids == (128001, 128008, 128009)  # generation_config.json wins over config.json
    assert config.bos_token_id == 128000
    assert config.dtype == torch.bfloat16
    assert not (config.attention_bias or config.o_proj_bias or config.mlp_bias or config.tie_word_embeddings)
    assert config.sliding_window is None


def test_mistral_7b_v01_sliding_window(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path, MISTRAL_7B_V01)
    config = load_model_config(model_dir)
    assert_matches_transformers(config, model_dir)
    assert config.sliding_window == 4096
    assert config.eos_token_ids == (2,)  # no generation_config.json: config.json's int
    assert config.rope.rope_type == "default" and config.rope.theta == 10000.0


@pytest.mark.parametrize(("window", "expected"), [("absent", 4096), (None, None), (32768, 32768)])
def test_mistral_window_defaults_like_transformers(tmp_path: Path, window: Any, expected: int | None) -> None:
    raw = copy.deepcopy(MISTRAL_7B_V01)
    if window == "absent":
        del raw["sliding_window"]
    else:
        raw["sliding_window"] = window
    model_dir = write_config(tmp_path, raw)
    config = load_model_config(model_dir)
    assert config.sliding_window == expected
    assert_matches_transformers(config, model_dir)


def test_qwen2_7b(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path, QWEN2_7B)
    config = load_model_config(model_dir)
    assert_matches_transformers(config, model_dir)
    assert config.head_dim == 128 and config.num_key_value_heads == 4
    assert config.sliding_window is None  # use_sliding_window false: the 131072 window is unused
    assert config.attention_bias and not config.o_proj_bias and not config.mlp_bias
    assert config.rope.theta == 1_000_000.0


def test_qwen2_sliding_on_every_layer_is_one_window(tmp_path: Path) -> None:
    raw = {**QWEN2_7B, "use_sliding_window": True, "max_window_layers": 0, "sliding_window": 8192}
    model_dir = write_config(tmp_path, raw)
    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert set(hf.layer_types) == {"sliding_attention"}
    assert load_model_config(model_dir).sliding_window == 8192


def test_qwen2_sliding_on_some_layers_is_refused(tmp_path: Path) -> None:
    raw = {**QWEN2_7B, "use_sliding_window": True, "max_window_layers": 14}
    with pytest.raises(ValueError, match=r"config\.json.*some layers"):
        load_model_config(write_config(tmp_path, raw))


def test_qwen3_0_6b(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path, QWEN3_0_6B)
    config = load_model_config(model_dir)
    assert_matches_transformers(config, model_dir)
    assert config.head_dim == 128 != config.hidden_size // config.num_attention_heads
    assert config.qk_norm and config.tie_word_embeddings and config.sliding_window is None
    assert not config.attention_bias and not config.o_proj_bias and not config.mlp_bias
    assert config.rope.theta == 1_000_000.0 and config.eos_token_ids == (151645,)


def test_qwen3_head_dim_defaults_like_transformers(tmp_path: Path) -> None:
    """Qwen3's head_dim defaults to 128, not hidden / heads (64 here)."""
    raw = {k: v for k, v in QWEN3_0_6B.items() if k != "head_dim"}
    model_dir = write_config(tmp_path, raw)
    assert_matches_transformers(load_model_config(model_dir), model_dir)
    assert load_model_config(model_dir).head_dim == 128


def test_qwen3_sliding_window_like_qwen2(tmp_path: Path) -> None:
    sliding = {**QWEN3_0_6B, "use_sliding_window": True, "sliding_window": 4096}
    every = write_config(tmp_path / "every", {**sliding, "max_window_layers": 0})
    assert set(AutoConfig.from_pretrained(every, local_files_only=True).layer_types) == {"sliding_attention"}
    assert load_model_config(every).sliding_window == 4096
    with pytest.raises(ValueError, match=r"config\.json.*some layers"):
        load_model_config(write_config(tmp_path / "some", {**sliding, "max_window_layers": 14}))
