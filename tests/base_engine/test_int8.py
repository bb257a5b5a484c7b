"""int8 base weights (`quantization="int8"`, base_engine/model/int8.py) against a float64 reference of
the dequantized weights, the layer against its definition, and the refusals.

The reference is `transformers` in float64 with every decoder linear replaced by `q * s`, quantized
per output row exactly as we do (a packed q/k/v row is a row of q, k or v, so the scales are the same).
Served in float32 the only differences left are float32 sums, so the float32 oracle's 1e-3 holds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from base_engine import LLM, EngineConfig, SamplingParams
from base_engine.model.int8 import Int8Linear, quantize_int8
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts

MAX_NEW = 10


def dequantized(w: torch.Tensor) -> torch.Tensor:
    """float64 `q * s` of a float32 weight, by the rule of the module docstring."""
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).double() * scale.double()[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_x_times_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight[3].zero_()  # an all-zero row stays zero
    q = Int8Linear(linear)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    x = torch.randn(5, 40).to(dtype)
    want = x.double() @ q.weight.double().t() + linear.bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q(x).double(), want, rtol=tol, atol=tol)
    # per-row error of round-to-nearest: half a step of that row's scale; in bf16 also the rounding of
    # s (|W| / s may pass 127 by 2^-8: clamped) and of q * s (2^-9 of up to 127 s): within one step
    err = (q.weight.float() - linear.weight.float()).abs().amax(dim=1)
    steps = 0.5 if dtype == torch.float32 else 1.0
    assert bool((err <= q.scale.float() * steps + 1e-6).all())


def test_lm_head_and_embeddings_stay_unquantized(make_checkpoint) -> None:
    with LLM(make_checkpoint(arch="llama"), dtype="float32", num_kv_blocks=8, quantization="int8") as llm:
        model = llm.engine.runner.model
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    kinds = {type(m).__name__ for m in model.model.layers.modules()}
    assert "Int8Linear" in kinds and "Linear" not in kinds


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_matches_float64_transformers_on_dequantized_weights(arch: str, make_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_checkpoint(arch=arch)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(dequantized(module.weight).float())
    hf = hf.double()
    prompts = random_prompts(3, 500, 3, 30, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    with LLM(model_dir, dtype="float32", num_kv_blocks=64, quantization="int8") as llm:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW)
        assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=arch)


@pytest.mark.parametrize("name", ["gptq", "awq", "bitsandbytes", "int4"])
def test_other_quantizations_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=rf"quantization .*{name}.*expected one of \['int8'\]"):
        EngineConfig(quantization=name)


def test_deterministic_mode_is_refused_in_int8(make_checkpoint) -> None:
    with pytest.raises(ValueError, match="deterministic mode is not available with quantization int8"):
        LLM(make_checkpoint(arch="llama"), dtype="float32", num_kv_blocks=8, quantization="int8",
            deterministic=True)  # fmt: skip


def test_quantize_counts_and_keeps_named_layers() -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(16, 8))
    model.add_module("lm_head", nn.Linear(8, 4))
    assert quantize_int8(model) == 1
    assert isinstance(model.proj, Int8Linear) and isinstance(model.lm_head, nn.Linear)
