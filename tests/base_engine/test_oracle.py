"""Greedy tokens and top-5 logprobs match transformers fp32 on a tiny checkpoint of every family
(tests/harness/families.py), on both attention paths, with and without chunked prefill and prefix hits."""

from __future__ import annotations

import pytest

from base_engine import LLM, SamplingParams
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, FAMILIES

MAX_NEW = 10


@pytest.mark.parametrize("variant", sorted(CHECKPOINTS))
def test_greedy_matches_transformers(variant, make_checkpoint, hf_model_cache) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS[variant])
    hf = hf_model_cache(model_dir)
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)
    prompts = random_prompts(4, 500, 3, 30, seed=len(variant))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW)
        assert out.finish_reason == "length"
        compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=variant)
    assert compared >= 2 * MAX_NEW, "too many near-ties: the check compared almost nothing"


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied"])
def test_chunked_lm_head_matches_transformers(
    variant, make_checkpoint, hf_model_cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU LM head in vocabulary chunks (an uneven last chunk here) still matches transformers."""
    import base_engine.model.decoder

    monkeypatch.setattr(base_engine.model.decoder, "LOGITS_CHUNK", 97)
    model_dir = make_checkpoint(**CHECKPOINTS[variant])
    hf = hf_model_cache(model_dir)
    assert hf.config.vocab_size > 97 and hf.config.vocab_size % 97
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)
    prompts = random_prompts(3, 500, 3, 30, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    compared = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW)
        compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=variant)
    assert compared >= MAX_NEW


@pytest.mark.parametrize("attention", ["buckets", "paged"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_path_matches_transformers(
    family: str, attention: str, make_checkpoint, hf_model_cache
) -> None:
    """A second wave of prompts reuses the first wave's prefix blocks; a token budget of 8 chunks every
    prefill, one of 64 chunks none. Each output is checked against transformers on its own."""
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
        assert llm.engine.runner.use_paged == (attention == "paged")
        outputs = llm.generate(first, params) + llm.generate(second, params)
        assert all(out.num_cached_tokens >= 12 for out in outputs[3:]), "the second wave must hit the cache"
        compared = 0
        for out, (ref_tokens, ref_lps) in zip(outputs, refs, strict=True):
            label = f"{family} {attention} budget {budget}"
            compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=label)
        assert compared >= 3 * MAX_NEW, "too many near-ties: the check compared almost nothing"
