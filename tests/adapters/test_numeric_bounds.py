"""Numeric bounds on uploads: non-finite alpha, and weights or scales whose delta can overflow the
serving dtype, are refused with the computed bound named (tested on both sides of the bound)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from adapters import AdapterValidationError, validate_adapter
from adapters.factors import max_activation
from adapters.format import load_adapter
from tests.harness.peft_adapters import edit_config, edit_tensors, save_peft_adapter, tiny_shapes

LIMITS = {"max_lora_rank": 64, "max_size_bytes": 10 << 20}
RANK = 8


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_peft_adapter(
        tmp_path_factory.mktemp("ref") / "a", r=RANK, target_modules=["q_proj", "v_proj"]
    )


@pytest.fixture
def adapter(reference_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(reference_dir, tmp_path / "a"))


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf, 1e38])
def test_alpha_that_is_not_finite_or_overflows_is_refused(adapter: Path, alpha: float) -> None:
    edit_config(adapter, lora_alpha=alpha)  # json writes NaN / Infinity, which json.loads accepts
    with pytest.raises(AdapterValidationError, match=r"scale|overflow"):
        validate_adapter(adapter, base=tiny_shapes(), **LIMITS)


def test_alpha_pattern_infinity_is_refused(adapter: Path) -> None:
    edit_config(adapter, alpha_pattern={"v_proj": math.inf})
    with pytest.raises(AdapterValidationError, match="v_proj"):
        validate_adapter(adapter, base=tiny_shapes(), **LIMITS)


def test_huge_finite_weights_are_refused(adapter: Path) -> None:
    edit_tensors(adapter, lambda t: {k: torch.full_like(v, 1e30) for k, v in t.items()})
    with pytest.raises(AdapterValidationError, match=r"can overflow torch.float32.*expected both <="):
        validate_adapter(adapter, base=tiny_shapes(), **LIMITS)


def _set_at_bound(adapter: Path, dtype: torch.dtype, factor: float) -> None:
    """A = ones (||A|| = in), B = v everywhere (||B|| = r v), scale = alpha / r = 1: the delta bound is
    r v in X. Choose v so the bound is `factor` times the dtype's max."""
    shapes = tiny_shapes()
    in_features = shapes.hidden_size
    x_max = max_activation(dtype)
    value = factor * torch.finfo(dtype).max / (RANK * in_features * x_max)
    edit_config(adapter, lora_alpha=RANK, alpha_pattern={}, rank_pattern={}, use_rslora=False)

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: torch.ones_like(v) if "lora_A" in k else torch.full_like(v, value) for k, v in tensors.items()
        }

    edit_tensors(adapter, edit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_delta_bound_on_both_sides(adapter: Path, dtype: torch.dtype) -> None:
    """The per-projection bound, which every load checks (an upload also checks the composed bound,
    which refuses both: tests/adapters/test_composition.py)."""
    _set_at_bound(adapter, dtype, 0.98)
    load_adapter(adapter, base=tiny_shapes(), dtype=dtype)  # just below: accepted
    _set_at_bound(adapter, dtype, 1.02)
    with pytest.raises(AdapterValidationError, match="the LoRA delta can overflow"):
        load_adapter(adapter, base=tiny_shapes(), dtype=dtype)


def test_realistic_adapter_is_far_inside_the_fp16_bound(reference_dir: Path) -> None:
    validate_adapter(reference_dir, base=tiny_shapes(), dtype=torch.float16, **LIMITS)
