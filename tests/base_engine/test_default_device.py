"""A caller's default device never reaches the engine's host tensors: `LLM.generate` inside
`with torch.device("meta")` gives the tokens it gives outside, on both attention paths, with an
adapter, a seeded sampled row and logprobs in the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from base_engine import LLM, SamplingParams
from tests.adapters.engine_helpers import make_adapter
from tests.harness.engine_inputs import random_prompts


@pytest.mark.parametrize("attention", ["buckets", "paged"])
def test_generate_under_a_meta_default_device_matches(
    attention: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    lora_dir = tmp_path / "lora"
    adapter = make_adapter(tiny_llama_dir, lora_dir, seed=1, r=4, target_modules=["q_proj", "v_proj"])
    llm = LLM(
        tiny_llama_dir,
        num_kv_blocks=96,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        attention=attention,
    )
    assert llm.engine.runner.use_paged == (attention == "paged")
    prompts = random_prompts(4, 500, 5, 20, seed=7)
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3),
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, top_p=0.9, seed=5),
    ]
    adapters = [None, str(adapter), str(adapter), None]
    expected = llm.generate(prompts, params, adapters=adapters)
    with torch.device("meta"):
        got = llm.generate(prompts, params, adapters=adapters)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got[0].logprobs, expected[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    llm.close()
