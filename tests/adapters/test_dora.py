"""DoRA's load-time scales against PEFT's own DoRA forward, the hostile magnitude files, and the bytes
the cache and the slot pool count for DoRA's vectors."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import torch

from adapters import AdapterFormatError, load_adapter
from adapters.cache import adapter_bytes
from adapters.dora import with_dora_scales
from adapters.slots import SlotPool
from adapters.types import AdapterValidationError
from tests.harness.peft_adapters import edit_config, edit_tensors, save_peft_adapter, tiny_model, tiny_shapes

MAG = "base_model.model.model.layers.{layer}.{block}.{module}.lora_magnitude_vector"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class HfWeights:
    """BaseWeights over a transformers model (the unpacked projections)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def _linear(self, layer: int, module: str) -> torch.nn.Linear:
        block = self.model.model.layers[layer]
        return getattr(block.self_attn if module in ALL[:4] else block.mlp, module)

    def weight(self, layer: int, module: str) -> torch.Tensor:
        return self._linear(layer, module).weight.detach()

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        bias = self._linear(layer, module).bias
        return None if bias is None else bias.detach()


def _dora_dir(tmp_path: Path, model_type: str = "llama", **kwargs: object) -> Path:
    """A PEFT DoRA adapter whose magnitudes moved off their init (m = ||W + s B A||, a scale of 1)."""
    kwargs.setdefault("target_modules", ALL)
    directory = save_peft_adapter(tmp_path / "dora", model_type, r=4, lora_alpha=8, use_dora=True, **kwargs)
    gen = torch.Generator().manual_seed(3)
    edit_tensors(
        directory,
        lambda t: {
            k: v * (0.5 + torch.rand(v.shape, generator=gen)) if "magnitude" in k else v for k, v in t.items()
        },
    )
    return directory


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_scales_reproduce_peft_dora_forward(model_type: str, tmp_path: Path) -> None:
    from peft import PeftModel

    directory = _dora_dir(tmp_path, model_type, use_rslora=True)
    model = tiny_model(model_type)  # the base the adapter was saved on (seed 0)
    adapter = with_dora_scales(load_adapter(directory, base=tiny_shapes(model_type)), HfWeights(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = PeftModel.from_pretrained(tiny_model(model_type), str(directory)).double()
    x = torch.randn(5, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    checked = 0
    for name, module in peft.named_modules():
        found = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$", name)
        if found is None or not hasattr(module, "lora_magnitude_vector"):
            continue
        layer, proj = int(found.group(1)), found.group(2)
        pair = adapter.weights[(layer, proj)]
        assert pair.magnitude is None and pair.out_scale is not None and pair.out_scale.dtype == torch.float32
        xs = x[:, : pair.a.shape[1]]
        with torch.no_grad():
            want = module(xs)  # PEFT's DoRA forward, float64
            base = module.get_base_layer()
            w, b = base.weight, base.bias
            ours = (
                xs @ w.T + (0 if b is None else b) + pair.scale * (xs @ pair.a.double().T) @ pair.b.double().T
            )
            ours = pair.out_scale.double() * ours
            if pair.out_shift is not None:
                ours = ours + pair.out_shift.double()
        assert (pair.out_shift is not None) == (b is not None), name
        torch.testing.assert_close(ours, want, rtol=2e-6, atol=2e-6, msg=name)
        checked += 1
    assert checked == 2 * len(ALL)


def _mag(module: str = "q_proj", layer: int = 0) -> str:
    return MAG.format(layer=layer, block="self_attn" if module in ALL[:4] else "mlp", module=module)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: {**t, _mag(): t[_mag()].index_fill(0, torch.tensor([0]), math.nan)},
            f"tensor {_mag()} has non-finite values (expected shape (64,))",
        ),
        (
            lambda t: {**t, _mag("down_proj", 1): torch.full((64,), math.inf)},
            f"tensor {_mag('down_proj', 1)} has non-finite values",
        ),
        (
            lambda t: {**t, _mag("k_proj"): t[_mag("k_proj")][:31].clone()},
            f"tensor {_mag('k_proj')} has shape (31,), expected (32,) (one magnitude per output feature",
        ),
        (lambda t: {**t, _mag(): t[_mag()][None]}, f"tensor {_mag()} has shape (1, 64), expected (64,)"),
        (
            lambda t: {k: v for k, v in t.items() if k != _mag("up_proj")},
            f"sets use_dora but tensor {_mag('up_proj')} is missing",
        ),
    ],  # fmt: skip
    ids=["nan", "inf", "short", "2d", "missing"],
)
def test_hostile_magnitudes_are_refused_naming_tensor_and_shape(edit, message: str, tmp_path: Path) -> None:
    directory = _dora_dir(tmp_path)
    edit_tensors(directory, edit)
    with pytest.raises(AdapterFormatError) as info:
        load_adapter(directory, base=tiny_shapes())
    assert message in str(info.value)


def test_magnitude_without_use_dora_is_refused(tmp_path: Path) -> None:
    directory = _dora_dir(tmp_path)
    edit_config(directory, use_dora=False)
    with pytest.raises(
        AdapterFormatError, match="DoRA magnitude vector, but adapter_config.json does not set use_dora"
    ):
        load_adapter(directory, base=tiny_shapes())


def test_zero_weight_norm_and_missing_base_weights_are_refused(tmp_path: Path) -> None:
    directory = _dora_dir(tmp_path, target_modules=["q_proj"])
    adapter = load_adapter(directory, base=tiny_shapes())
    with pytest.raises(AdapterFormatError, match="use_dora needs the base model's weights"):
        with_dora_scales(adapter, None)
    model = tiny_model("llama")
    pair = adapter.weights[(0, "q_proj")]
    with torch.no_grad():  # row 2 of W and of the delta are zero: ||W + s B A|| = 0 there
        model.model.layers[0].self_attn.q_proj.weight[2] = 0.0
        pair.b[2] = 0.0
    with pytest.raises(
        AdapterValidationError, match=r"layer 0 q_proj: DoRA scale .* not finite at output features \[2\]"
    ):
        with_dora_scales(adapter, HfWeights(model))


def test_cache_and_pool_count_the_vectors(tmp_path: Path) -> None:
    directory = _dora_dir(tmp_path)
    adapter = with_dora_scales(load_adapter(directory, base=tiny_shapes()), HfWeights(tiny_model("llama")))
    factors = sum(p.a.numel() + p.b.numel() for p in adapter.weights.values()) * 4
    vectors = sum(p.b.shape[0] for p in adapter.weights.values()) * 4  # one out_scale per module (no bias)
    assert adapter_bytes(adapter) == factors + vectors
    llama, qwen2 = tiny_shapes(), tiny_shapes("qwen2")
    qwen2 = type(qwen2)(
        **{**{f: getattr(qwen2, f) for f in qwen2.__slots__}, "bias_modules": ("q_proj", "k_proj", "v_proj")}
    )
    factor_bytes = 2 * (64 + 64 + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)) * 8 * 4
    widths = 2 * (128 + 64 + 256 + 64)  # qkv, o, gate_up, down output widths over both layers
    assert SlotPool.bytes_per_slot(llama, 8, torch.float32) == factor_bytes + 4 * widths
    assert SlotPool.bytes_per_slot(qwen2, 8, torch.float32) == factor_bytes + 4 * (widths + 2 * 128)
