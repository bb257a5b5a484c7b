"""RoPE frequencies and rotations against transformers' own (modeling_rope_utils, LlamaRotaryEmbedding)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from base_engine.model.config import RopeConfig, load_model_config
from base_engine.model.rope import RopeCache, apply_rope, rope_cos_sin, rope_inv_freq

LLAMA31 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CASES: list[tuple[str, dict[str, Any], int]] = [
    ("default-128", {"rope_type": "default", "rope_theta": 10000.0}, 128),
    ("default-odd-theta-48", {"rope_type": "default", "rope_theta": 1_000_000.0}, 48),
    ("linear", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 64),
    ("llama3.1", LLAMA31, 128),
    ("llama3-small-head", {**LLAMA31, "factor": 32.0, "high_freq_factor": 8.0}, 64),
    (
        "yarn",
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
        128,
    ),
    (
        "yarn-mscale-no-truncate",
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
        64,
    ),
]


def _hf_config(params: dict[str, Any], head_dim: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=131072,
        rope_parameters=dict(params),
    )


def _ours_from_disk(tmp_path: Path, hf_config: LlamaConfig) -> Any:
    """Our RopeConfig parsed from the config.json transformers writes (end to end through config.py)."""
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.save_pretrained(tmp_path)
    return load_model_config(tmp_path)


@pytest.mark.parametrize(("name", "params", "head_dim"), CASES, ids=[c[0] for c in CASES])
def test_inv_freq_matches_transformers(
    tmp_path: Path, name: str, params: dict[str, Any], head_dim: int
) -> None:
    hf_config = _hf_config(params, head_dim)
    if params["rope_type"] == "default":
        ref, ref_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        ref, ref_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, "cpu")
    config = _ours_from_disk(tmp_path, hf_config)
    inv_freq, scaling = rope_inv_freq(config.rope, config.head_dim)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(inv_freq, ref.float(), rtol=1e-7, atol=0)
    assert scaling == pytest.approx(ref_scaling, rel=1e-12)
    if params["rope_type"] != "default":
        # The scaling really changes something, so a parser that dropped it would fail above.
        assert not torch.equal(inv_freq, rope_inv_freq(RopeConfig("default", config.rope.theta), head_dim)[0])


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]], ids=["default", "llama3", "yarn"])
def test_cos_sin_and_rotation_match_transformers(
    tmp_path: Path, case: tuple[str, dict[str, Any], int]
) -> None:
    _, params, head_dim = case
    hf_config = _hf_config(params, head_dim)
    rotary = LlamaRotaryEmbedding(hf_config)
    config = _ours_from_disk(tmp_path, hf_config)
    # Two sequences flattened: positions [0..4] then [100..106], plus a far position.
    positions = torch.tensor([0, 1, 2, 3, 4, 100, 101, 102, 103, 104, 105, 106, 60000])
    num_tokens, num_heads = positions.numel(), 3
    x = torch.randn(1, num_heads, num_tokens, head_dim)
    ref_cos, ref_sin = rotary(x, positions[None, :])  # [1, T, D]
    inv_freq, scaling = rope_inv_freq(config.rope, config.head_dim)
    cos, sin = rope_cos_sin(inv_freq, positions, scaling)
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=1e-6)

    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, 1, head_dim)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_rotation_preserves_relative_position() -> None:
    """<R(m) q, R(n) k> depends only on m - n: the property RoPE exists for (float64 check)."""
    inv_freq, _ = rope_inv_freq(RopeConfig(rope_type="default", theta=10000.0), 32)
    q, k = torch.randn(1, 1, 32, dtype=torch.float64), torch.randn(1, 1, 32, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        cos, sin = rope_cos_sin(inv_freq.double(), torch.tensor([m, n]))
        cos, sin = cos.double(), sin.double()
        rq = apply_rope(q, cos[:1], sin[:1])
        rk = apply_rope(k, cos[1:], sin[1:])
        return float((rq * rk).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-6)
    assert score(7, 3) != pytest.approx(score(8, 3), rel=1e-6)


def test_rope_cache_matches_direct_and_grows(tmp_path: Path) -> None:
    hf_config = _hf_config(LLAMA31, 64)
    config = _ours_from_disk(tmp_path, hf_config)
    cache = RopeCache(config.rope, config.head_dim, dtype=torch.bfloat16, device=torch.device("cpu"))
    inv_freq, scaling = rope_inv_freq(config.rope, config.head_dim)
    for positions in (torch.tensor([0, 5, 3]), torch.tensor([4000, 0, 1, 9000])):
        cos, sin = cache(positions)
        ref_cos, ref_sin = rope_cos_sin(inv_freq, positions, scaling)
        assert cos.dtype == torch.bfloat16 and cos.shape == (positions.numel(), 64)
        torch.testing.assert_close(cos, ref_cos.to(torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(sin, ref_sin.to(torch.bfloat16), rtol=0, atol=0)
    assert cache.cos.shape[0] >= 9001


def test_rope_parameters_written_by_transformers_round_trip(tmp_path: Path) -> None:
    """The file really carries rope_parameters (transformers 5 form) that we read, not our defaults."""
    hf_config = _hf_config(LLAMA31, 128)
    config = _ours_from_disk(tmp_path, hf_config)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == "llama3"
    assert config.rope.rope_type == "llama3" and config.rope.theta == 500000.0
    assert config.rope.original_max_position_embeddings == 8192 and config.rope.factor == 8.0
