"""The composed bound at upload (adapters/composition.py): adapters whose every projection passes the
per-projection bound but whose deltas overflow where they meet (q.k logits, the MLP's gate x up, the
residual stream feeding the next RMSNorm) are refused with the figure; tested on both sides of the
logits bound, and realistic adapters pass in every serving dtype."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from adapters import AdapterValidationError, validate_adapter
from adapters.factors import max_activation
from adapters.format import load_adapter
from tests.harness.peft_adapters import edit_config, edit_tensors, save_peft_adapter, tiny_shapes

LIMITS = {"max_lora_rank": 64, "max_size_bytes": 10 << 20}
RANK = 4
FP32_MAX = torch.finfo(torch.float32).max


def _adapter(tmp_path: Path, modules: list[str]) -> Path:
    return save_peft_adapter(tmp_path / "a", r=RANK, lora_alpha=RANK, target_modules=modules)


def _set_gain(adapter: Path, gains: dict[str, float]) -> None:
    """A = ones, B = v: with scale 1 each projection's delta gain is r * v * in_features, set to
    gains[projection] (`composition.delta_gain`, exactly)."""
    base = tiny_shapes()

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            module = next(m for m in gains if f".{m}." in name)
            in_features = base.module_shape(module)[0]
            value = gains[module] / (RANK * in_features)
            out[name] = torch.ones_like(t) if "lora_A" in name else torch.full_like(t, value)
        return out

    edit_config(adapter, lora_alpha=RANK, use_rslora=False, alpha_pattern={}, rank_pattern={})
    edit_tensors(adapter, edit)


def _logits_gain(factor: float) -> float:
    """The q and k gain G at which sqrt(head_dim) (D (X + D) + X D), D = G X, is `factor` * fp32 max."""
    x, d = max_activation(torch.float32), tiny_shapes().head_dim
    delta = -x + math.sqrt(x * x + factor * FP32_MAX / math.sqrt(d))
    return delta / x


def test_logits_bound_on_both_sides(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, ["q_proj", "k_proj"])
    _set_gain(adapter, {"q_proj": _logits_gain(0.95), "k_proj": _logits_gain(0.95)})
    validate_adapter(adapter, base=tiny_shapes(), **LIMITS)  # just below: accepted
    _set_gain(adapter, {"q_proj": _logits_gain(1.05), "k_proj": _logits_gain(1.05)})
    load_adapter(adapter, base=tiny_shapes())  # each projection on its own is within its bound
    with pytest.raises(AdapterValidationError, match=r"layer 0: .*attention logits.* can reach 3\.5\de\+38"):
        validate_adapter(adapter, base=tiny_shapes(), **LIMITS)


def test_mlp_product_that_overflows_is_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, ["gate_proj", "up_proj"])
    _set_gain(adapter, {"gate_proj": 1e15, "up_proj": 1e15})  # deltas 6.6e19 each, product 4.7e39
    load_adapter(adapter, base=tiny_shapes())
    with pytest.raises(AdapterValidationError, match=r"MLP product's change \(gate/up deltas\) can reach"):
        validate_adapter(adapter, base=tiny_shapes(), **LIMITS)


def test_residual_stream_that_would_overflow_the_next_norm_is_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, ["down_proj"])
    limit = math.sqrt(FP32_MAX / tiny_shapes().hidden_size)
    x = max_activation(torch.float32)
    # One layer's addition stays below the limit, the two layers' sum passes it.
    _set_gain(adapter, {"down_proj": 0.7 * limit / x})
    load_adapter(adapter, base=tiny_shapes())
    with pytest.raises(AdapterValidationError, match=r"layer 1: .*residual stream's change summed"):
        validate_adapter(adapter, base=tiny_shapes(), **LIMITS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_realistic_all_linear_adapter_passes(tmp_path: Path, dtype: torch.dtype) -> None:
    adapter = save_peft_adapter(tmp_path / "a", r=8, lora_alpha=16, target_modules="all-linear")
    validate_adapter(adapter, base=tiny_shapes(), dtype=dtype, **LIMITS)


def test_fp16_leaves_products_to_the_engine(tmp_path: Path) -> None:
    """fp16 has no headroom for products (adapters/composition.py): a gate/up pair within the
    per-projection bound passes there, and the engine's non-finite check is what ends a request that
    overflows."""
    adapter = _adapter(tmp_path, ["gate_proj", "up_proj"])
    _set_gain(adapter, {"gate_proj": 100.0, "up_proj": 100.0})
    validate_adapter(adapter, base=tiny_shapes(), dtype=torch.float16, **LIMITS)
