"""Every adapter kind of issue 26 in one mixed batch against PEFT (fp32): base rows, plain LoRA, DoRA,
embedding LoRA, lm_head LoRA, modules_to_save lm_head + embed_tokens copies and norm copies, on both CPU
LoRA schedules (bags / segment loop), both attention paths (buckets / paged) and in deterministic mode.
Each kind's own file tests it alone and on the other families (test_engine_dora.py, _embedding, _lm_head,
_modules_to_save)."""

from __future__ import annotations

from pathlib import Path

import pytest

from base_engine import LLM, SamplingParams
from tests.adapters.engine_helpers import (
    ALL_SEVEN,
    make_adapter,
    make_saved_adapter,
    peft_references,
    pin_schedule,
)
from tests.base_engine.oracle import assert_greedy_match
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, FAMILIES

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
NAMES = [None, "lora_qv", "dora", "embedding", "lm_head", "copies", "norms", None, "dora", "copies"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, d = tmp_path_factory.mktemp("every_kind"), tiny_llama_dir
    return {
        "lora_qv": make_adapter(d, root / "qv", seed=300, r=8, target_modules=["q_proj", "v_proj"]),
        "dora": make_adapter(d, root / "dora", seed=301, r=8, use_dora=True, target_modules=ALL_SEVEN),
        "embedding": make_adapter(d, root / "emb", seed=302, r=8, target_modules=["embed_tokens", "o_proj"]),
        "lm_head": make_adapter(d, root / "head", seed=303, r=8, target_modules=["lm_head", "q_proj"]),
        "copies": make_saved_adapter(d, root / "copies", seed=304, r=4, target_modules=["v_proj"],
                                     modules_to_save=["lm_head", "embed_tokens"]),
        "norms": make_saved_adapter(d, root / "norms", seed=305, r=4, target_modules=["k_proj"],
                                    modules_to_save=["norm"]),
    }  # fmt: skip


@pytest.fixture(scope="module")
def references(tiny_llama_dir: Path, adapters: dict[str, Path]) -> dict:
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=306)
    return {"prompts": prompts, "refs": peft_references(tiny_llama_dir, adapters, NAMES, prompts, MAX_NEW)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "attention", "deterministic"),
    [("bag", "buckets", False), ("loop", "paged", False), ("bag", "paged", True), ("loop", "buckets", True)],
)
def test_every_kind_in_one_batch_matches_peft(
    tiny_llama_dir, adapters, references, monkeypatch, schedule: str, attention: str, deterministic: bool
) -> None:
    pin_schedule(monkeypatch, schedule)
    llm = LLM(
        tiny_llama_dir, num_kv_blocks=160, block_size=4, max_loras=6, max_lora_rank=8,
        max_num_batched_tokens=48, attention=attention, deterministic=deterministic,
    )  # fmt: skip
    outs = llm.generate(references["prompts"], GREEDY, adapters=[adapters[n] if n else None for n in NAMES])
    label = f"{schedule}/{attention}/{'det' if deterministic else 'fast'}"
    compared = 0
    for i, out in enumerate(outs):
        assert out.finish_reason == "length", (label, i, out.error)
        ref_tokens, ref_lps = references["refs"][i]
        compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps,
                                        label=f"{label} {NAMES[i]} #{i}")  # fmt: skip
    assert compared >= len(NAMES) * MAX_NEW - 4  # near-ties may cut a comparison short


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_embedding_head_and_copies_on_every_family_match_peft(family: str, make_checkpoint, tmp_path) -> None:
    """Embedding and lm_head LoRA with norm copies in one adapter, lm_head and embed_tokens copies in
    another, beside base rows, on each served family (tied heads, Gemma's scaled embedding and soft-cap,
    Phi-3's fused projections)."""
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    lora = make_saved_adapter(model_dir, tmp_path / "l", seed=310, r=4, modules_to_save=["norm"],
                              target_modules=["embed_tokens", "lm_head", "o_proj"])  # fmt: skip
    copies = make_saved_adapter(model_dir, tmp_path / "c", seed=311, r=4, target_modules=["o_proj"],
                                modules_to_save=["lm_head", "embed_tokens"])  # fmt: skip
    picks = [lora, None, copies, lora]
    prompts = random_prompts(len(picks), 500, 4, 12, seed=312)
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_loras=2, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, adapters=picks)
    refs = peft_references(model_dir, {"l": lora, "c": copies}, ["l", None, "c", "l"], prompts, MAX_NEW)
    for i, out in enumerate(outs):
        assert_greedy_match(out.token_ids, out.logprobs, *refs[i], label=f"{family} #{i}")
