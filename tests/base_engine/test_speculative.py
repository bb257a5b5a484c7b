"""n-gram speculation is lossless: the same tokens (and logprobs within tolerance) as without it,
greedy and seeded, in a batch, with a tiny pool (preemption)."""

from __future__ import annotations

import pytest

from base_engine import LLM, SamplingParams
from base_engine.speculative.ngram import NgramProposer
from base_engine.speculative.verify import accepted_tokens
from tests.harness.engine_inputs import random_prompts


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(max_n=3)
    assert proposer.propose("r", [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3], 2) == [5, 7]
    assert proposer.propose("r", [1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert proposer.propose("r", [5, 6, 7], 4) == []


def test_accepted_tokens_stop_at_the_first_mismatch() -> None:
    assert accepted_tokens([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accepted_tokens([4, 5], [4, 5, 8]) == [4, 5, 8]
    assert accepted_tokens([4], [3, 0]) == [3]


@pytest.mark.parametrize("num_kv_blocks", [None, 12])
def test_ngram_speculation_changes_no_token(tiny_llama_dir, num_kv_blocks) -> None:
    base = random_prompts(4, 500, 6, 12, seed=21)
    prompts = [p + p + p for p in base]  # repeats: the proposer finds matches
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=9, ignore_eos=True),
    ]
    opts = {"num_kv_blocks": num_kv_blocks, "block_size": 4} if num_kv_blocks else {}
    with LLM(tiny_llama_dir, **opts) as llm:
        alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    with LLM(
        tiny_llama_dir, speculative="ngram", num_speculative_tokens=3, speculative_off_batch=0, **opts
    ) as llm:
        batch = llm.generate(prompts, params)
        stats = llm.engine.speculator.stats
    for a, b in zip(alone, batch, strict=True):
        assert b.token_ids == a.token_ids
        for la, lb in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    assert stats.num_draft_tokens[""] > 0
