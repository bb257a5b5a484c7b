"""Mixture-of-experts bases (Qwen3-MoE, Mixtral, Qwen2-MoE; per-expert and fused checkpoint layouts)
match transformers fp32 greedy tokens and top-5 logprobs on both attention paths, chunked and with
prefix hits, under preemption; deterministic mode keeps a request's bits alone and in a batch.
(test_oracle.py's first test also runs every MoE variant once: CHECKPOINTS holds them.)"""

from __future__ import annotations

import pytest

from base_engine import LLM, SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, MOE_FAMILIES

MAX_NEW = 10


@pytest.mark.parametrize("attention", ["buckets", "paged"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_path_matches_transformers(
    family: str, attention: str, make_checkpoint, hf_model_cache
) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    hf = hf_model_cache(model_dir)
    first = random_prompts(3, 500, 14, 30, seed=21)
    second = [p[:12] + q for p, q in zip(first, random_prompts(3, 500, 2, 9, seed=22), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    refs = [hf_greedy(hf, prompt, MAX_NEW) for prompt in first + second]
    for budget in (8, 64):
        llm = LLM(
            model_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=budget, attention=attention
        )
        outputs = llm.generate(first, params) + llm.generate(second, params)
        assert all(out.num_cached_tokens >= 12 for out in outputs[3:]), "the second wave must hit the cache"
        compared = 0
        for out, (ref_tokens, ref_lps) in zip(outputs, refs, strict=True):
            label = f"{family} {attention} budget {budget}"
            compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=label)
        assert compared >= 3 * MAX_NEW, "too many near-ties: the check compared almost nothing"


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral-window", "qwen2-moe"])
def test_moe_under_preemption(family: str, make_checkpoint, hf_model_cache) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    hf = hf_model_cache(model_dir)
    prompts = random_prompts(3, 500, 18, 30, seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    llm = LLM(model_dir, num_kv_blocks=16, block_size=4, max_num_batched_tokens=5)
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW)
        compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=family)
    assert compared >= 2 * MAX_NEW


# Many-row steps on every MoE family: tests/base_engine/test_batch_invariance.py.
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral-window", "qwen2-moe"])
def test_deterministic_mode_is_batch_invariant(family: str, make_checkpoint) -> None:
    """A sampled deterministic request answers bitwise the same alone and among other requests (whose
    tokens change which experts hold how many rows), chunked differently."""
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    prompts = random_prompts(6, 500, 5, 30, seed=31)
    target = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=3, logprobs=3, deterministic=True)

    def run(others: list[list[int]], chunk: int) -> tuple:
        config = EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=8)
        engine = LLMEngine(model_dir, config=config)
        for i, prompt in enumerate(others):
            engine.add_request(
                f"o{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            )
        engine.add_request("t", prompts[0], target)
        finished = {}
        while engine.has_unfinished:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        return finished["t"].token_ids, finished["t"].logprobs

    alone = run([], 512)
    assert run(prompts[1:], 16) == alone
    assert run(prompts[1:4], 48) == alone
