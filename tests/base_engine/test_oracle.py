"""Greedy tokens and top-5 logprobs match transformers on tiny Llama / Mistral / Qwen2 checkpoints."""

from __future__ import annotations

import pytest

from base_engine import LLM, SamplingParams
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts

MAX_NEW = 10

VARIANTS = {
    "llama-gqa": {"arch": "llama"},
    "llama-tied": {"arch": "llama", "tie_word_embeddings": True, "seed": 3},
    "llama3-rope-headdim": {
        "arch": "llama",
        "head_dim": 32,
        "seed": 4,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 500000.0,
    },
    "mistral": {"arch": "mistral", "seed": 1},
    "mistral-window": {"arch": "mistral", "seed": 5, "sliding_window": 12},
    "qwen2-bias": {"arch": "qwen2", "seed": 2},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(variant, make_checkpoint, hf_model_cache) -> None:
    model_dir = make_checkpoint(**VARIANTS[variant])
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
    model_dir = make_checkpoint(**VARIANTS[variant])
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
