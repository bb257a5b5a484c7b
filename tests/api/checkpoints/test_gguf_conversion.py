"""GGUF -> HF conversion (api/checkpoints/gguf.py, gguf_config.py) per family, against the model the
file was written from: tiny transformers models with their quirks switched on (Llama 3 RoPE, Qwen3's
head_dim != hidden/heads and YaRN, Gemma 2's soft-caps and attention scale, Gemma 3's local/global RoPE
and sliding layers, Phi-3's LongRoPE and partial rotary), written as llama.cpp does
(tests/api/checkpoints/gguf_writer.py), converted back, and compared: config fields, every tensor,
the tokenizer, logits past the sliding window and the original context, and (llama) greedy tokens
(transformers, fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    Phi3Config,
    PreTrainedModel,
    Qwen3Config,
)

from api.checkpoints.gguf import convert_gguf
from base_engine.testing.checkpoint import _randomize_, save_random_checkpoint
from base_engine.testing.tokenizer import build_tokenizer
from tests.api.checkpoints.gguf_writer import write_gguf

Q8 = gguf.GGMLQuantizationType.Q8_0
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "long_factor": [1.0, 2.5, 4.0, 8.0],
    "short_factor": [1.0, 1.25, 1.5, 2.0],
    "original_max_position_embeddings": 16,
}
FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "qwen3": (
        Qwen3Config,
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "tie_word_embeddings": True,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                             "original_max_position_embeddings": 16}},
    ),
    "gemma2": (
        Gemma2Config,
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "query_pre_attn_scalar": 16, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0,
         "sliding_window": 8},
    ),
    "gemma3": (
        Gemma3TextConfig,
        {"num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "query_pre_attn_scalar": 32, "sliding_window": 8,
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    "phi3": (
        Phi3Config,
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "tie_word_embeddings": True, "original_max_position_embeddings": 16, "rope_parameters": LONGROPE},
    ),
}  # fmt: skip
# The fields that change the math; each must come back as the model had it.
FIELDS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
    "tie_word_embeddings", "rope_parameters", "sliding_window", "layer_types", "query_pre_attn_scalar",
    "attn_logit_softcapping", "final_logit_softcapping", "original_max_position_embeddings",
    "hidden_activation", "hidden_act", "max_position_embeddings",
)  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was a small model"


def _tiny(family: str, tmp_path: Path) -> PreTrainedModel:
    if family == "llama":  # Llama 3.x RoPE, which llama.cpp stores as a rope_freqs tensor
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
        path = save_random_checkpoint(tmp_path / "hf", arch="llama", head_dim=16, rope_parameters=rope)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config_cls, fields = FAMILIES[family]
    tokenizer = build_tokenizer(512)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": None,
    }
    config = config_cls(**SHAPE, **fields, **ids)
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_(model, 1.6)  # the tiny checkpoints' weights (base_engine/testing/checkpoint.py)
    if family.startswith("gemma"):  # norm weights whose 1 + w (as llama.cpp stores them) is exact
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(torch.round(param * 1024) / 1024)
    return model.eval()


def _round_to_q8_(model: PreTrainedModel) -> None:
    """Weights Q8_0 keeps exactly, so the converted model can be compared bit for bit."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                data = param.numpy()
                param.copy_(
                    torch.from_numpy(gguf.dequantize(gguf.quants.quantize(data, Q8), Q8).reshape(data.shape))
                )


def _logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi3"])
def test_gguf_converts_back_to_the_model(family: str, tmp_path: Path) -> None:
    model = _tiny(family, tmp_path)
    quant = Q8 if family == "gemma3" else gguf.GGMLQuantizationType.F32  # dequantized by `gguf`
    if quant == Q8:
        _round_to_q8_(model)
    tokenizer = build_tokenizer(512)
    src = write_gguf(model, tokenizer, tmp_path / f"{family}.gguf", quant=quant)
    out = convert_gguf(src, tmp_path / "converted", progress=False)

    expected, got = model.config.to_dict(), AutoConfig.from_pretrained(out).to_dict()
    assert {k: got.get(k) for k in FIELDS} == {k: expected.get(k) for k in FIELDS}
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = model.state_dict()
    have = converted.state_dict()
    assert sorted(have) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(have[name], tensor), name
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > 16  # past the sliding window (8) and LongRoPE's original context (16)
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    # every token keeps its id (transformers' tokenizer classes may add their default specials after them)
    assert {t: i for t, i in vocab.items() if i < len(tokenizer)} == tokenizer.backend_tokenizer.get_vocab()
    if not family.startswith("gemma"):  # transformers' Gemma class splits a byte-level vocabulary its own way
        assert AutoTokenizer.from_pretrained(out)(PROMPT).input_ids == ids[0].tolist()
    assert torch.equal(_logits(converted, ids), _logits(model, ids))
    if family == "llama":
        kwargs = {"max_new_tokens": 6, "do_sample": False}
        assert torch.equal(converted.generate(ids, **kwargs), model.generate(ids, **kwargs))
