"""LoRA on mixture-of-experts bases (Qwen3-MoE, Mixtral, Qwen2-MoE): adapters on attention only, on the
experts only (PEFT `target_parameters` on the fused expert tensors) and on both (plus the dense layers'
MLP and Qwen2-MoE's shared expert, with rank / alpha patterns), in one mixed batch with base rows: each
row gives the greedy tokens and top-5 logprobs of `peft` in float32, on both CPU LoRA schedules and in
deterministic mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from base_engine import LLM, SamplingParams
from base_engine.model.config import load_model_config
from kernels.sgmv import torch_bag
from tests.adapters.engine_helpers import make_adapter, peft_model
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, MOE_FAMILIES

MAX_NEW = 6
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
NAMES = [None, "attn", "experts", "both", None, "experts", "both", "attn"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)


def moe_adapters(model_dir: Path, out: Path) -> dict[str, Path]:
    """attention only; experts only (r 8); both, with a rank pattern on the down tensor and an alpha
    pattern on q_proj, and (where the family has them) the dense layers' MLP and Qwen2-MoE's shared
    expert through target_parameters on their weights: PEFT converts MLP names in target_modules into
    the expert tensors on these families (its transformers-v5 MoE conversion), so the weights are the
    one way to reach a dense or shared MLP."""
    base = load_model_config(model_dir).base_shapes()
    has_mlp = any(base.has_mlp(layer) for layer in range(base.num_layers))
    mlp = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"] if has_mlp else []
    return {
        "attn": make_adapter(model_dir, out / "attn", seed=1, r=4, lora_alpha=8, target_modules=ATTENTION),
        "experts": make_adapter(
            model_dir,
            out / "experts",
            seed=2,
            r=8,
            lora_alpha=16,
            target_modules=[],
            target_parameters=EXPERTS,
        ),  # fmt: skip
        "both": make_adapter(
            model_dir,
            out / "both",
            seed=3,
            r=4,
            lora_alpha=4,
            target_modules=ATTENTION,
            target_parameters=EXPERTS + mlp,
            rank_pattern={"experts.down_proj": 8},
            alpha_pattern={"q_proj": 12},
        ),  # fmt: skip
    }


def _pin_schedule(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    if schedule == "loop":
        monkeypatch.setattr(torch_bag, "BAG_MIN_SEGMENTS", 1 << 20)
    else:
        monkeypatch.setattr(torch_bag, "BAG_SEGMENT_BYTES", 1 << 40)


def run_mixed(model_dir: Path, adapters: dict[str, Path], prompts: list, **engine) -> list:
    with LLM(model_dir, num_kv_blocks=128, block_size=4, max_loras=3, max_lora_rank=8, **engine) as llm:
        return llm.generate(prompts, GREEDY, adapters=[adapters[n] if n else None for n in NAMES])


def compare_with_peft(
    model_dir: Path, adapters: dict[str, Path], prompts: list, outs: list, label: str
) -> int:
    compared = 0
    for name in (None, "attn", "experts", "both"):
        reference = peft_model(model_dir, adapters[name] if name else None)  # fp32: grouped_mm has no fp64
        for i, n in enumerate(NAMES):
            if n != name:
                continue
            assert outs[i].finish_reason == "length", (label, n, outs[i].error)
            ref_tokens, ref_lps = hf_greedy(reference, prompts[i], MAX_NEW)
            compared += assert_greedy_match(
                outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"{label} {name} #{i}"
            )
    return compared


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_attention_expert_and_mixed_adapters_match_peft(family: str, make_checkpoint, tmp_path) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    adapters = moe_adapters(model_dir, tmp_path)
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=71)
    outs = run_mixed(model_dir, adapters, prompts)
    assert compare_with_peft(model_dir, adapters, prompts, outs, family) >= len(NAMES) * MAX_NEW - 6


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "deterministic"), [("loop", False), ("bag", True)])
def test_expert_lora_on_both_schedules_and_deterministic_matches_peft(
    schedule: str, deterministic: bool, make_checkpoint, tmp_path, monkeypatch
) -> None:
    _pin_schedule(monkeypatch, schedule)
    model_dir = make_checkpoint(**CHECKPOINTS["qwen3-moe"])
    adapters = moe_adapters(model_dir, tmp_path)
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=72)
    outs = run_mixed(model_dir, adapters, prompts, deterministic=deterministic, max_num_batched_tokens=32)
    label = f"{schedule}/{'det' if deterministic else 'fast'}"
    assert compare_with_peft(model_dir, adapters, prompts, outs, label) >= len(NAMES) * MAX_NEW - 6
