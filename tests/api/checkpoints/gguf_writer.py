"""A tiny HF model written as llama.cpp's `convert_hf_to_gguf.py` writes its family, with the `gguf`
package: the metadata keys it sets (and only those), its tensor names, its tensor transforms (Llama's
q/k row permutation, Gemma's norm weights stored as 1 + w), LongRoPE and Llama 3 RoPE stored as
tensors, and the byte-level BPE tokenizer as a `gpt2` vocabulary. The conversion tests turn such a file
back into a checkpoint with api/checkpoints/gguf.py and compare it with the model it came from."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

_ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


def write_gguf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    path: Path,
    *,
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write `model` + `tokenizer` to `path` as GGUF; 2-D weights in `quant` (norms, factors in F32).
    `extra_tensors` and `drop` add and leave out tensors (for the refusal tests)."""
    cfg = model.config
    arch = _ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    _write_hparams(writer, cfg, arch)
    _write_tokenizer(writer, tokenizer, unk=arch.startswith("gemma"))
    for name, data in _tensors(model, arch) + list((extra_tensors or {}).items()):
        if name in drop:
            continue
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rope(cfg: Any) -> dict[str, Any]:
    rope = cfg.rope_parameters
    return rope["full_attention"] if "full_attention" in rope else rope


def _write_hparams(writer: gguf.GGUFWriter, cfg: Any, arch: str) -> None:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = _rope(cfg)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    if head_dim != cfg.hidden_size // heads or arch in ("gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch in ("gemma2", "gemma3") and cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        ratio = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(ratio) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast, *, unk: bool) -> None:
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(True)
    if unk:  # transformers' Gemma tokenizer class needs one; the byte-level test vocabulary has none
        writer.add_unk_token_id(tokenizer.eos_token_id)


def _tensors(model: PreTrainedModel, arch: str) -> list[tuple[str, np.ndarray]]:
    cfg = model.config
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers
    )
    out = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            n_head = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            data = data.reshape(n_head, 2, data.shape[0] // n_head // 2, *data.shape[1:])
            data = data.swapaxes(1, 2).reshape(tensor.shape)  # llama.cpp's LlamaModel.permute
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1.0
        out.append((name, data))
    out += _rope_tensors(cfg)
    return out


def _rope_tensors(cfg: Any) -> list[tuple[str, np.ndarray]]:
    rope = _rope(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if rope["rope_type"] == "longrope":
        return [
            ("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)),
            ("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)),
        ]
    if rope["rope_type"] != "llama3":
        return []
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    original = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs:  # llama.cpp's LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return [("rope_freqs.weight", np.asarray(factors, dtype=np.float32))]
