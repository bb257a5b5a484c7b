"""LoRA on mixture-of-experts bases (Qwen3-MoE, Mixtral, Qwen2-MoE): adapters on attention only, on the
experts only (PEFT `target_parameters` on the fused expert tensors), on both (plus the dense layers'
MLP and Qwen2-MoE's shared expert, with rank / alpha patterns) and PEFT's all-linear (the router and
Qwen2-MoE's shared-expert gate too), in one mixed batch with base rows: each
row gives the greedy tokens and top-5 logprobs of `peft` in float32, on both CPU LoRA schedules and in
deterministic mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from base_engine import LLM, SamplingParams
from kernels.sgmv import cost_model
from kernels.sgmv.cost_model import ScheduleCosts
from tests.adapters.engine_helpers import peft_model
from tests.adapters.moe_helpers import moe_adapters
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, MOE_FAMILIES

MAX_NEW = 6
NAMES = [None, "attn", "experts", "both", None, "linear", "both", "attn", "experts", "linear"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)


def _pin_schedule(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    # loop: the bag schedule costs 1 s to start; else segments of <= 2 rows to bags, longer ones to
    # the loop, whatever the widths (cost_model.py: a segment saves W us out of the loop, a bag row
    # costs 0.4 W us)
    if schedule == "loop":
        costs = ScheduleCosts(1.0, 0.0, 0.0, 0.0, 0.0)
    else:
        costs = ScheduleCosts(0.0, 0.4e-6, 0.0, 1e-6, 0.0)
    monkeypatch.setattr(cost_model, "costs_for", lambda dtype, device: costs)


def run_mixed(model_dir: Path, adapters: dict[str, Path], prompts: list, **engine) -> list:
    with LLM(model_dir, num_kv_blocks=128, block_size=4, max_loras=4, max_lora_rank=8, **engine) as llm:
        return llm.generate(prompts, GREEDY, adapters=[adapters[n] if n else None for n in NAMES])


def compare_with_peft(
    model_dir: Path, adapters: dict[str, Path], prompts: list, outs: list, label: str
) -> int:
    compared = 0
    for name in (None, "attn", "experts", "both", "linear"):
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
