"""Subnormal factors are flushed to zero when an adapter is parsed (upload and every load), in the
serving dtype: nothing the engine stores is subnormal, every normal value is kept bit for bit, and
the upload is accepted (the flushed values change no output the dtype can represent next to a normal
activation)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters import validate_adapter
from adapters.format import load_adapter
from tests.harness.peft_adapters import edit_tensors, save_peft_adapter, tiny_shapes

LIMITS = {"max_lora_rank": 64, "max_size_bytes": 10 << 20}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_peft_adapter(
        tmp_path_factory.mktemp("ref") / "a", r=4, target_modules=["q_proj", "down_proj"]
    )


def _subnormal_count(t: torch.Tensor) -> int:
    return int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum())


def _with_subnormals(reference_dir: Path, tmp_path: Path, value: float) -> Path:
    """Every other element of every factor set to `value` (subnormal in the serving dtype)."""
    adapter = Path(shutil.copytree(reference_dir, tmp_path / "a"))

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            t = t.clone()
            t.view(-1)[::2] = value
            out[name] = t
        return out

    edit_tensors(adapter, edit)
    return adapter


@pytest.mark.parametrize(
    ("dtype", "value"), [(torch.float32, 1e-40), (torch.float16, 1e-6), (torch.bfloat16, 1e-39)]
)
def test_subnormal_factors_are_stored_as_zero(
    reference_dir: Path, tmp_path: Path, dtype: torch.dtype, value: float
) -> None:
    adapter_dir = _with_subnormals(reference_dir, tmp_path, value)
    assert _subnormal_count(torch.tensor([value], dtype=dtype)) == 1  # the value is subnormal in `dtype`
    loaded = load_adapter(adapter_dir, base=tiny_shapes(), dtype=dtype)
    untouched = load_adapter(reference_dir, base=tiny_shapes(), dtype=dtype)
    for key, pair in loaded.weights.items():
        for got, clean in ((pair.a, untouched.weights[key].a), (pair.b, untouched.weights[key].b)):
            assert _subnormal_count(got) == 0, key
            assert torch.equal(got.view(-1)[::2], torch.zeros_like(got.view(-1)[::2]))
            assert torch.equal(got.view(-1)[1::2], clean.view(-1)[1::2])  # normal values, bit for bit
    summary = validate_adapter(adapter_dir, base=tiny_shapes(), dtype=dtype, **LIMITS)
    assert summary.modules == ("q_proj", "down_proj")


def test_an_adapter_without_subnormals_is_unchanged(reference_dir: Path) -> None:
    raw = load_file(str(reference_dir / "adapter_model.safetensors"))
    loaded = load_adapter(reference_dir, base=tiny_shapes())
    for (layer, module), pair in loaded.weights.items():
        prefix = (
            f"base_model.model.model.layers.{layer}.{'self_attn' if module == 'q_proj' else 'mlp'}.{module}"
        )
        assert torch.equal(pair.a, raw[f"{prefix}.lora_A.weight"])
        assert torch.equal(pair.b, raw[f"{prefix}.lora_B.weight"])
