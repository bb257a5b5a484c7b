"""config.json fields one by one, on the published Llama 3.1 8B config
(tests/base_engine/published_configs.py):
both RoPE forms (transformers 5's rope_parameters, the legacy `type` key), eos ids from config.json and
generation_config.json, dtype fields, and refusals that name the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from base_engine.model.config import load_model_config
from tests.base_engine.published_configs import (
    LLAMA31_8B,
    write_config,
)


def test_rope_parameters_form(tmp_path: Path) -> None:
    """transformers 5 writes rope_theta inside rope_parameters; no top-level rope_theta or rope_scaling."""
    raw = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    raw["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    config = load_model_config(write_config(tmp_path, raw))
    legacy = load_model_config(write_config(tmp_path / "legacy", LLAMA31_8B))
    assert config.rope == legacy.rope
    assert config.rope.theta == 500000.0 and config.rope.rope_type == "llama3"


def test_legacy_type_key(tmp_path: Path) -> None:
    raw = {**LLAMA31_8B, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 10000.0}
    model_dir = write_config(tmp_path, raw)
    config = load_model_config(model_dir)
    assert (config.rope.rope_type, config.rope.factor) == ("linear", 2.0)
    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert hf.rope_parameters["rope_type"] == "linear"


@pytest.mark.parametrize(
    ("config_eos", "generation", "expected"),
    [
        (128001, {"eos_token_id": [128009, 128001]}, (128009, 128001)),
        (128001, {"eos_token_id": 128009}, (128009,)),
        ([128001, 128008], None, (128001, 128008)),
        (128001, {"bos_token_id": 128000}, (128001,)),  # generation_config.json without eos
        (None, None, ()),
    ],
)
def test_eos_ids(tmp_path: Path, config_eos: Any, generation: dict[str, Any] | None, expected: tuple) -> None:
    raw = {**LLAMA31_8B, "eos_token_id": config_eos}
    assert load_model_config(write_config(tmp_path, raw, generation)).eos_token_ids == expected


def test_tiny_eos_from_generation_config(tiny_llama_dir: Path) -> None:
    generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    config = load_model_config(tiny_llama_dir)
    assert config.eos_token_ids == tuple(generation["eos_token_id"]) and len(config.eos_token_ids) == 2


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"dtype": "float16", "torch_dtype": None}, torch.float16),
        ({"torch_dtype": None}, torch.float32),
        ({"torch_dtype": "float32"}, torch.float32),
    ],
)
def test_dtype_fields(tmp_path: Path, raw: dict[str, Any], field: torch.dtype) -> None:
    merged = {k: v for k, v in {**LLAMA31_8B, **raw}.items() if v is not None}
    assert load_model_config(write_config(tmp_path, merged)).dtype == field


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"architectures.*GPT2LMHeadModel.*LlamaForCausalLM"),
        ({"architectures": None}, r"architectures"),
        ({"model_type": "mistral"}, r"model_type"),
        ({"hidden_act": "gelu"}, r"hidden_act.*gelu"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"rope type 'longrope'"),
        ({"rope_scaling": {"rope_type": "linear"}}, r"factor"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantization_config"),
        ({"torch_dtype": "float8_e4m3fn"}, r"dtype 'float8_e4m3fn'"),
        ({"hidden_size": None}, r"hidden_size"),
        ({"vocab_size": "128256"}, r"vocab_size"),
        ({"num_key_value_heads": 5}, r"num_key_value_heads=5"),
        (
            {"sliding_window": 0, "architectures": ["MistralForCausalLM"], "model_type": "mistral"},
            r"sliding_window",
        ),
        ({"rope_scaling": {**LLAMA31_8B["rope_scaling"], "high_freq_factor": 1.0}}, r"high_freq_factor"),
        ({"rope_theta": -1.0}, r"theta"),
        ({"eos_token_id": "</s>"}, r"eos_token_id"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, r"rope_parameters"),
    ],
)
def test_refusals_name_file_and_field(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    raw = {k: v for k, v in {**LLAMA31_8B, **change}.items() if not (k == "hidden_size" and v is None)}
    with pytest.raises(ValueError, match=message) as excinfo:
        load_model_config(write_config(tmp_path, raw))
    assert str(tmp_path / "config.json") in str(excinfo.value)


def test_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model_config(tmp_path)


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)
