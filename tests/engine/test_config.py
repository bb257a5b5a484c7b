"""config.json parsing: tiny checkpoints written by transformers and published configs, checked against
transformers' own AutoConfig and against the tensors actually stored in the checkpoint."""

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
from base_engine.config import ModelConfig, load_model_config

# Published config.json files (fields and values as released on the Hugging Face hub).
LLAMA31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
MISTRAL_ARCH = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
LLAMA31_8B_INSTRUCT_GENERATION = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
QWEN2_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.37.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}


def write_config(directory: Path, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def assert_matches_transformers(config: ModelConfig, model_dir: Path) -> None:
    """The fields transformers itself derives (defaults, head_dim, effective window) agree with ours."""
    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert config.model_type == hf.model_type
    assert config.vocab_size == hf.vocab_size
    assert config.hidden_size == hf.hidden_size
    assert config.intermediate_size == hf.intermediate_size
    assert config.num_hidden_layers == hf.num_hidden_layers
    assert config.num_attention_heads == hf.num_attention_heads
    assert config.num_key_value_heads == hf.num_key_value_heads
    assert config.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.sliding_window == getattr(hf, "sliding_window", None)
    assert config.rope.theta == hf.rope_parameters["rope_theta"]
    assert config.rope.rope_type == hf.rope_parameters["rope_type"]


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
    ],
    ids=["llama", "llama-bias", "mistral", "qwen2", "llama-head_dim-mqa"],
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
