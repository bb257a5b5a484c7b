"""compressed-tensors int8 checkpoints (base_engine/model/compressed_tensors.py), built here with the
`compressed-tensors` package itself (as llmcompressor writes them for vLLM), against a float64 reference.

The reference is `transformers` in float64 with every decoder linear's weight replaced by the
checkpoint's own `q * weight_scale` (read straight from its safetensors file, not through our loader),
and, for W8A8, each linear's input quantized per token as vLLM does (s = max|x| / 127, round half to
even, saturate to [-128, 127], times s) by a forward pre-hook. Served in float32 the differences left
are float32 sums, plus the rare activation that lands on the other side of a rounding boundary (one
int8 step of one element): logprobs within the float32 oracle's 1e-3 (measured within 1e-5 on these
prompts), and the greedy tokens equal for all the steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from base_engine import LLM, SamplingParams
from base_engine.model.int8 import Int8Linear
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts

MAX_NEW = 10
ATOL = 1e-3


def build_int8_checkpoint(src: Path, out: Path, preset: str) -> Path:
    """`preset` applied to the float checkpoint `src` with compressed-tensors: per-channel absmax
    scales (what llmcompressor's minmax observer computes), compressed to int8. "W8A8" is the library's
    preset; "W8A16" is its weights without input activations (the library's own "W8A16" preset is
    group-128, which we refuse by name)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    if preset == "W8A16":
        scheme.input_activations = None
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                scale = module.weight.abs().amax(dim=1, keepdim=True) / 127.0
                module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for file in src.glob("tok*"):
        (out / file.name).write_bytes(file.read_bytes())
    return out


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint, tmp_path_factory) -> dict[str, Path]:
    src = make_checkpoint(arch="llama")
    root = tmp_path_factory.mktemp("ct")
    return {p: build_int8_checkpoint(src, root / p, p) for p in ("W8A8", "W8A16")}


def quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """vLLM's dynamic per-token symmetric int8 activation quantization, dequantized, in x's dtype."""
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp(-128, 127) * s


def reference(model_dir: Path, float_dir: Path, *, is_w8a8: bool) -> nn.Module:
    """float64 `transformers` from `float_dir` (the same architecture, unquantized), every decoder
    linear's weight replaced by `model_dir`'s stored `q * weight_scale`."""
    from transformers import AutoModelForCausalLM

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float64).eval()
    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
            q, s = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
            assert q.dtype == torch.int8
            with torch.no_grad():
                module.weight.copy_(q.double() * s.double())
            if is_w8a8:
                module.register_forward_pre_hook(lambda _m, args: (quantize_per_token(args[0]),))
    return hf


@pytest.mark.parametrize("preset", ["W8A8", "W8A16"])
def test_int8_checkpoint_matches_float64_reference(preset: str, checkpoints, make_checkpoint) -> None:
    model_dir = checkpoints[preset]
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    hf = reference(model_dir, make_checkpoint(arch="llama"), is_w8a8=preset == "W8A8")
    prompts = random_prompts(3, 500, 3, 30, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    with LLM(model_dir, dtype="float32", num_kv_blocks=64) as llm:
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear)]
        outs = llm.generate(prompts, params)
    assert len(layers) == 2 * 4  # 2 layers x (qkv, o, gate_up, down)
    assert all(m.is_dynamic_activations == (preset == "W8A8") for m in layers)
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW)
        n = assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, atol=ATOL, label=preset)
        assert n == MAX_NEW, f"{preset}: diverged at a near-tie at step {n}"


def test_int8_checkpoint_serves_in_bfloat16(checkpoints) -> None:
    with LLM(checkpoints["W8A8"], dtype="bfloat16", num_kv_blocks=16) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def _with_quantization(model_dir: Path, tmp_path: Path, edit) -> Path:  # noqa: ANN001 - edit(config)
    out = tmp_path / "edited"
    out.mkdir()
    for file in model_dir.iterdir():
        (out / file.name).symlink_to(file)
    (out / "config.json").unlink()
    config = json.loads((model_dir / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def _static(qc: dict) -> None:
    qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")


def _asymmetric(qc: dict) -> None:
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False


def _int4(qc: dict) -> None:
    qc["format"] = "pack-quantized"


def _grouped(qc: dict) -> None:
    qc["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128)


def _ignore_more(qc: dict) -> None:
    qc["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]


def _awq(qc: dict) -> None:
    qc.clear()
    qc["quant_method"] = "awq"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_static, r"static activation quantization .*input_scale"),
        (_asymmetric, r"weights \{'symmetric': False\}"),
        (_int4, r"format 'pack-quantized'"),
        (_grouped, r"weights group_size/block_structure 128"),
        (_ignore_more, r"ignore \['lm_head', 'model.layers.0.mlp.down_proj'\]"),
        (_awq, r"quant_method 'awq'.*not served"),
    ],
)
def test_other_schemes_are_refused_by_name(edit, match: str, checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    model_dir = _with_quantization(checkpoints["W8A8"], tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, dtype="float32", num_kv_blocks=8)


def test_deterministic_mode_is_refused(checkpoints) -> None:
    with pytest.raises(ValueError, match="deterministic mode is not available with quantization int8"):
        LLM(checkpoints["W8A8"], dtype="float32", num_kv_blocks=8, deterministic=True)
