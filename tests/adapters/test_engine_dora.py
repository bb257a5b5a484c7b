"""DoRA in the engine against PEFT: one adapter, several distinct ones in a batch with base rows and
plain-LoRA rows, on both CPU LoRA schedules (bags / segment loop), both attention paths (buckets and
paged) and in deterministic mode; Qwen2 (q/k/v biases, which DoRA does not rescale); one DoRA adapter
on every projection of each served family (Phi-3's fused qkv_proj / gate_up_proj included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from base_engine import LLM, SamplingParams
from base_engine.model.config import load_model_config
from tests.adapters.engine_helpers import ALL_SEVEN, make_adapter, peft_model, pin_schedule
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, FAMILIES

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
NAMES = [None, "dora_all", "lora_qv", "dora_qv_down", "dora_mlp_rs", None, "dora_all", "lora_qv"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dora")
    specs = {
        "dora_all": dict(r=8, lora_alpha=16, use_dora=True, target_modules=ALL_SEVEN),
        "dora_qv_down": dict(r=4, lora_alpha=8, use_dora=True,
                             target_modules=["q_proj", "v_proj", "down_proj"]),
        "dora_mlp_rs": dict(r=16, lora_alpha=8, use_rslora=True, use_dora=True,
                            target_modules=["gate_proj", "up_proj"]),
        "lora_qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    }  # fmt: skip
    return {
        name: make_adapter(tiny_llama_dir, root / name, seed=40 + i, **spec)
        for i, (name, spec) in enumerate(specs.items())
    }


@pytest.fixture(scope="module")
def references(tiny_llama_dir: Path, adapters: dict[str, Path]) -> dict:
    """PEFT's greedy tokens and logprobs per (prompt index) for the mixed batch of NAMES."""
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=41)
    refs: dict[int, tuple] = {}
    for name in set(NAMES):
        model = peft_model(tiny_llama_dir, adapters[name] if name else None)
        for i, n in enumerate(NAMES):
            if n == name:
                refs[i] = hf_greedy(model, prompts[i], MAX_NEW)
    return {"prompts": prompts, "refs": refs}


def _compare(outs, references, indices, label: str) -> int:
    compared = 0
    for i in indices:
        ref_tokens, ref_lps = references["refs"][i]
        out = outs[i]
        assert out.finish_reason == "length", (label, out.error)
        compared += assert_greedy_match(
            out.token_ids, out.logprobs, ref_tokens, ref_lps, label=f"{label} #{i}"
        )
    return compared


def test_one_dora_adapter_matches_peft(tiny_llama_dir, adapters, references) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=4, max_loras=2, max_lora_rank=16)
    picks = [i for i, n in enumerate(NAMES) if n == "dora_all"]
    prompts = references["prompts"]
    outs = llm.generate([prompts[i] for i in picks], GREEDY, adapters=[adapters["dora_all"]] * len(picks))
    by_index = dict(zip(picks, outs, strict=True))
    assert _compare(by_index, references, picks, "dora_all") >= len(picks) * MAX_NEW - 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "attention", "deterministic"),
    [("bag", "buckets", False), ("loop", "paged", False), ("bag", "paged", True), ("loop", "buckets", True)],
)
def test_mixed_dora_lora_base_batch_matches_peft(
    tiny_llama_dir, adapters, references, monkeypatch, schedule: str, attention: str, deterministic: bool
) -> None:
    pin_schedule(monkeypatch, schedule)
    llm = LLM(
        tiny_llama_dir, num_kv_blocks=128, block_size=4, max_loras=4, max_lora_rank=16,
        max_num_batched_tokens=48, attention=attention, deterministic=deterministic,
    )  # fmt: skip
    outs = llm.generate(references["prompts"], GREEDY, adapters=[adapters[n] if n else None for n in NAMES])
    label = f"{schedule}/{attention}/{'det' if deterministic else 'fast'}"
    compared = _compare(outs, references, range(len(NAMES)), label)
    assert compared >= len(NAMES) * MAX_NEW - 4  # near-ties may cut a comparison short


def test_qwen2_dora_on_biased_qkv_matches_peft(tiny_qwen2_dir, tmp_path) -> None:
    dora = make_adapter(tiny_qwen2_dir, tmp_path / "d", seed=50, r=8, use_dora=True, target_modules=ALL_SEVEN)
    prompts = random_prompts(3, 500, 4, 12, seed=51)
    llm = LLM(tiny_qwen2_dir, num_kv_blocks=64, block_size=4, max_loras=2, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, adapters=[dora, None, dora])
    for i, adapter in enumerate([dora, None, dora]):
        ref_tokens, ref_lps = hf_greedy(peft_model(tiny_qwen2_dir, adapter), prompts[i], MAX_NEW)
        assert_greedy_match(outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"qwen2 #{i}")


@pytest.mark.parametrize("family", FAMILIES)
def test_dora_on_every_family_matches_peft(family: str, make_checkpoint, tmp_path: Path) -> None:
    """On Phi-3 the magnitude of a fused projection is split by the same rows as B (adapters/format.py):
    dropping it there would serve plain LoRA, which this test tells apart (make_adapter moves m off the
    norm)."""
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    every = list(load_model_config(model_dir).base_shapes().projections)
    dora = make_adapter(model_dir, tmp_path / "d", seed=60, r=8, use_dora=True, target_modules=every)
    prompts = random_prompts(3, 500, 4, 12, seed=61)
    picks = [dora, None, dora]
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_loras=2, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, adapters=picks)
    peft = peft_model(model_dir, dora)
    base = peft_model(model_dir, None)
    for i, adapter in enumerate(picks):
        ref_tokens, ref_lps = hf_greedy(peft if adapter else base, prompts[i], MAX_NEW)
        assert_greedy_match(outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"{family} #{i}")
