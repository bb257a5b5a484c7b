"""vLLM's `prompt_logprobs` against transformers' `log_softmax` over the prompt in fp32: each prompt
token's logprob and rank, its top-N; the same under chunked prefill, preemption, paged attention,
batch-invariant steps and a warm prefix cache (the request skips the cache:
base_engine/prompt_logprobs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from base_engine import LLM, SamplingParams
from tests.harness.engine_inputs import random_prompts

ATOL = 1e-3  # the engine's logprob tolerance against transformers (tests/base_engine/oracle.py)
TOP = 4


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the distribution of prompt token p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check(hf, prompt: list[int], got, num_top: int, label: str) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None, label
    ref = _reference(hf, prompt)
    for p, entry in enumerate(got[1:]):
        row, token = ref[p], prompt[p + 1]
        assert next(iter(entry.logprobs)) == token, label  # the prompt token first
        assert abs(entry.rank - (int((row > row[token]).sum()) + 1)) <= 1, (label, p)  # ties within ATOL
        for t, logprob in entry.logprobs.items():
            assert abs(logprob - row[t].item()) <= ATOL, (label, p, t)
        others = [t for t in entry.logprobs if t != token]
        assert len(entry.logprobs) in (num_top, num_top + 1) or num_top == 0, label
        if num_top:  # the alternatives are the top N (up to near-ties)
            kth = row.topk(num_top).values[-1].item()
            assert all(row[t].item() >= kth - ATOL for t in others), (label, p)
        else:
            assert others == [], label


@pytest.mark.parametrize(
    ("label", "options", "request_options"),
    [
        ("whole prompt", {}, {}),
        ("chunked by 5", {"max_num_batched_tokens": 5}, {}),
        ("preempted", {"num_kv_blocks": 24, "max_num_batched_tokens": 64}, {}),
        ("paged attention", {"attention": "paged", "max_num_batched_tokens": 16}, {}),
        ("batch-invariant", {"max_num_batched_tokens": 16}, {"deterministic": True}),
    ],
)
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf, label, options, request_options) -> None:
    prompts = random_prompts(6, 500, 2, 40, seed=21)
    llm = LLM(tiny_llama_dir, **{"num_kv_blocks": 256, "block_size": 4, **options})
    params = SamplingParams(
        temperature=0.0, max_tokens=8, prompt_logprobs=TOP, ignore_eos=True, **request_options
    )
    outputs = llm.generate(prompts, params)
    if label == "preempted":
        assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.runner.use_paged == (label == "paged attention")
    for prompt, out in zip(prompts, outputs, strict=True):
        _check(hf, prompt, out.prompt_logprobs, TOP, label)


def test_a_prefix_hit_does_not_skip_positions(tiny_llama_dir, hf) -> None:
    shared = random_prompts(1, 500, 30, 30, seed=22)[0]
    llm = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=4)
    llm.generate([shared + [5, 6]], SamplingParams(temperature=0.0, max_tokens=2))  # warms the cache
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    out = llm.generate([shared + [7, 8]], params)[0]
    assert out.num_cached_tokens == 0  # it skipped the cache
    _check(hf, shared + [7, 8], out.prompt_logprobs, 0, "after a prefix hit")
    again = llm.generate([shared + [7, 9]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0  # what it computed was still published


def test_without_the_field_nothing_is_scored(tiny_llama_dir) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.prompt_logprobs is None
