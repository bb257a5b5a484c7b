"""Published config.json files (Llama 3.1 8B, Mistral 7B v0.1, Qwen2 7B, Qwen3 0.6B) and the helpers
that write them into a model directory and compare our parse with transformers' AutoConfig; shared by
test_config.py, test_config_fields.py and test_unsupported.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from base_engine.model.config import ModelConfig

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

QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
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
