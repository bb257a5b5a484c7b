"""Greedy tokens and top-5 logprobs match transformers on tiny Llama / Mistral / Qwen2 / Gemma 2 / Gemma 3
checkpoints; for Gemma, on both attention paths, with and without chunked prefill, prefix hits and
preemption (its per-layer windows and soft-caps are where those paths differ)."""

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
    # Gemma 3: 5 windowed layers (window 8 < the prompts) and a global one, local and global RoPE
    # bases, linear scaling on the global layers, q/k norms, query_pre_attn_scalar, tied embeddings.
    "gemma3-window": {
        "arch": "gemma3",
        "seed": 6,
        "num_hidden_layers": 6,
        "head_dim": 32,
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 100.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "tie_word_embeddings": True,
    },
    # The text model of Gemma3ForConditionalGeneration (vision tower present in the file, not loaded).
    "gemma3-vision": {
        "arch": "gemma3-vision",
        "seed": 7,
        "num_hidden_layers": 6,
        "head_dim": 32,
        "sliding_window": 6,
        "query_pre_attn_scalar": 32,
        "tie_word_embeddings": True,
    },
    # Gemma 2: alternating windowed / global layers, attention and final-logit soft-caps small enough
    # to bind (scores and logits reach several times the caps), tied embeddings.
    "gemma2-softcap": {
        "arch": "gemma2",
        "seed": 8,
        "num_hidden_layers": 4,
        "head_dim": 32,
        "sliding_window": 8,
        "query_pre_attn_scalar": 4,
        "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True,
    },
}
GEMMA = sorted(v for v in VARIANTS if v.startswith("gemma"))


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


def _paths(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts, then as many sharing each one's first 16 tokens (prefix-cache hits, block size 4)."""
    tails = random_prompts(len(prompts), 500, 3, 12, seed=99)
    return prompts + [p[:16] + t for p, t in zip(prompts, tails, strict=True)]


@pytest.mark.parametrize("attention", ["buckets", "paged"])
@pytest.mark.parametrize("variant", GEMMA)
def test_gemma_paths_match_transformers(variant, attention, make_checkpoint, hf_model_cache) -> None:
    """Windows shorter than the prompts hold whether a prompt arrives whole, in chunks of 5, on top of
    cached prefix blocks, or is preempted and recomputed; on the bucketed and the paged path."""
    model_dir = make_checkpoint(**VARIANTS[variant])
    hf = hf_model_cache(model_dir)
    if variant == "gemma3-vision":
        assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    prompts = _paths(random_prompts(2, 500, 18, 30, seed=21))
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    # (tokens per step, KV blocks): chunked (whole prompts: test_greedy_matches_transformers); too few
    # blocks for all, so some are preempted and recomputed.
    for chunk, blocks in ((5, 96), (8, 16)):
        llm = LLM(
            model_dir, num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=chunk, attention=attention
        )
        assert llm.engine.runner.use_paged == (attention == "paged")
        first = llm.generate(prompts[:2], params)
        second = llm.generate(prompts[2:], params)
        assert sum(o.num_cached_tokens for o in second) >= 2 * 16 or blocks < 96
        if blocks < 96:
            assert llm.engine.stats().num_preemptions > 0
        compared = 0
        for (ref_tokens, ref_lps), out in zip(refs, first + second, strict=True):
            label = f"{variant} {attention} chunk={chunk} blocks={blocks}"
            compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=label)
        assert compared >= 3 * MAX_NEW
