"""Phi3ForCausalLM config.json and RoPE against transformers: Phi-3-mini-4k (sliding window 2047),
Phi-3-mini-128k (LongRoPE) and Phi-4-mini (partial rotary 0.75, tied, LongRoPE)
shaped configs parse as AutoConfig reads them; the short and long frequencies, the attention factor and
the partial rotation equal transformers' own; what Phi3 cannot honour is refused by name."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from base_engine.model.config import load_model_config
from base_engine.model.rope import RopeCache, apply_rope, rope_cos_sin, rope_inv_freq
from tests.base_engine.published_configs import LLAMA31_8B, assert_matches_transformers, write_config

# Phi-3-mini-4k-instruct's config.json as published (fields and values).
PHI3_MINI_4K: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32064,
}
# Phi-3-mini-128k's shape: LongRoPE, 48 factors per set (head_dim 96); the factor values here are made
# up, increasing like the published ones.
PHI3_MINI_128K = PHI3_MINI_4K | {
    "max_position_embeddings": 131072,
    "sliding_window": 262144,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.01 * i for i in range(48)],
        "long_factor": [1.0 + 0.5 * i for i in range(48)],
    },
}
# Phi-4-mini-instruct's fields (factor values made up): partial rotary 0.75 of head_dim 128 -> 96 dims.
PHI4_MINI = {
    k: v
    for k, v in PHI3_MINI_128K.items()
    if k not in ("rope_scaling", "num_key_value_heads", "vocab_size", "num_attention_heads")
} | {
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 200064,
    "bos_token_id": 199999,
    "eos_token_id": 199999,
    "pad_token_id": 199999,
    "partial_rotary_factor": 0.75,
    "tie_word_embeddings": True,
    "full_attn_mod": 1,  # unused by transformers' Phi3 (and by us)
    "lm_head_bias": False,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.02 * i for i in range(48)],
        "long_factor": [1.0 + 1.5 * i for i in range(48)],
    },
}


def _hf(model_dir: Path):
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def test_phi3_mini_4k_window_and_default_rope(tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, PHI3_MINI_4K))
    assert_matches_transformers(config, tmp_path)
    assert config.sliding_window == 2047 and config.rope.rope_type == "default"
    assert config.rope.long_factor_after is None
    assert not (config.attention_bias or config.o_proj_bias or config.mlp_bias)
    assert config.base_shapes().projections == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.mark.parametrize("raw", [PHI3_MINI_128K, PHI4_MINI], ids=["phi3-mini-128k", "phi4-mini"])
def test_longrope_configs_match_transformers(raw: dict[str, Any], tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, raw))
    hf = _hf(tmp_path)
    assert_matches_transformers(config, tmp_path)
    rope, params = config.rope, hf.rope_parameters
    assert rope.original_max_position_embeddings == params["original_max_position_embeddings"] == 4096
    assert rope.long_factor_after == 4096
    assert (
        list(rope.short_factor) == params["short_factor"] and list(rope.long_factor) == params["long_factor"]
    )
    assert rope.partial_rotary_factor == params["partial_rotary_factor"]
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]
    for long in (False, True):
        # transformers picks the long set when seq_len > original (its dynamic update asks with original + 1)
        ref, ref_scaling = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=4097 if long else None)
        inv_freq, scaling = rope_inv_freq(rope, config.head_dim, long=long)
        assert inv_freq.shape == (rope.rotary_dim(config.head_dim) // 2,)
        torch.testing.assert_close(inv_freq, ref, rtol=0, atol=0)
        assert scaling == ref_scaling and scaling > 1  # 131072 / 4096 = 32: sqrt(1 + ln 32 / ln 4096)


def test_original_length_comes_from_the_top_level_field(tmp_path: Path) -> None:
    """Phi3Config gives the top-level original_max_position_embeddings priority over the RoPE object's,
    and defaults it to 4096 when absent."""
    raw = copy.deepcopy(PHI3_MINI_128K)
    raw["rope_scaling"]["original_max_position_embeddings"] = 1024
    del raw["original_max_position_embeddings"]
    config = load_model_config(write_config(tmp_path, raw))
    assert config.rope.original_max_position_embeddings == _hf(tmp_path).rope_parameters[
        "original_max_position_embeddings"
    ] == 4096  # fmt: skip


def test_partial_rotation_matches_phi3_rotary(tmp_path: Path) -> None:
    raw = PHI4_MINI | {"rope_scaling": None}
    config = load_model_config(write_config(tmp_path, raw))
    hf = _hf(tmp_path)
    rotary = Phi3RotaryEmbedding(hf)
    positions = torch.tensor([0, 1, 2, 77, 4000])
    x = torch.randn(1, 2, positions.numel(), config.head_dim)
    ref_cos, ref_sin = rotary(x, positions[None])
    inv_freq, scaling = rope_inv_freq(config.rope, config.head_dim)
    cos, sin = rope_cos_sin(inv_freq, positions, scaling)
    assert cos.shape == (5, 96)
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
    q, k = torch.randn(5, 24, 128), torch.randn(5, 8, 128)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1), rtol=0, atol=1e-5)
    assert torch.equal(apply_rope(q, cos, sin)[..., 96:], q[..., 96:])  # the last quarter passes through


def test_rope_cache_holds_both_factor_sets(tmp_path: Path) -> None:
    config = load_model_config(write_config(tmp_path, PHI4_MINI))
    cache = RopeCache(
        config.rope, config.head_dim, dtype=torch.float32, device=torch.device("cpu"), max_positions=64
    )
    assert cache.row_offset(False) == 0 and cache.row_offset(True) == 64
    positions = torch.tensor([0, 5, 63])
    for long in (False, True):
        inv_freq, scaling = rope_inv_freq(config.rope, config.head_dim, long=long)
        ref_cos, ref_sin = rope_cos_sin(inv_freq, positions, scaling)
        cos, sin = cache(positions + cache.row_offset(long))
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    with pytest.raises(ValueError, match="past the LongRoPE table"):
        cache(torch.tensor([128]))


def _refused(tmp_path: Path, raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model_config(write_config(tmp_path, raw))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "Phi3 rope type 'linear' unsupported"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "Phi3 rope type 'dynamic' unsupported"),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 47}},
            r"`long_factor` has 47 entries; expected rotary_dim / 2 = 48",
        ),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}},
            r"`long_factor` must be a list of positive numbers; found None",
        ),
        (
            {
                "rope_scaling": {
                    "type": "longrope",
                    "short_factor": [1.0] * 48,
                    "long_factor": [1.0] * 48,
                    "mscale": 2,
                }
            },
            r"rope parameters \['mscale'\] unsupported for Phi3",
        ),
        (
            {"rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48}},
            "'su' .* transformers 5 does not load it either; expected 'longrope'",
        ),
        ({"partial_rotary_factor": 0.7}, r"rotates int\(96 \* 0.7\) dims; expected an even number"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' unsupported"),
        ({"rope_theta": "10000"}, r"rope `rope_theta` must be a positive number; found '10000'"),
        (
            {
                "rope_scaling": {
                    "type": "longrope",
                    "short_factor": [1.0] * 48,
                    "long_factor": [1.0] * 48,
                    "attention_factor": -1.0,
                }
            },
            r"rope `attention_factor` must be a positive number; found -1.0",
        ),  # fmt: skip
    ],
    ids=[
        "linear",
        "dynamic",
        "short-list",
        "missing-list",
        "unknown-key",
        "su",
        "odd-rotary",
        "activation",
        "theta-string",
        "negative-attention-factor",
    ],  # fmt: skip
)
def test_what_phi3_cannot_honour_is_refused(tmp_path: Path, change: dict[str, Any], match: str) -> None:
    _refused(tmp_path, PHI3_MINI_4K | change, match)


def test_partial_rotary_and_longrope_stay_refused_on_llama(tmp_path: Path) -> None:
    """transformers' Llama has no whole-sequence recompute when LongRoPE switches: not ours to guess."""
    _refused(tmp_path / "a", LLAMA31_8B | {"partial_rotary_factor": 0.5}, "partial rotary: Phi3 only")
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}
    _refused(tmp_path / "b", LLAMA31_8B | {"rope_scaling": longrope}, "rope type 'longrope' unsupported")
