"""The engine on `kernels.attention` (the GPU path; its PyTorch twin here) gives the tokens and
logprobs of the bucketed CPU path: decodes, chunked prefills over cached prefix blocks, sliding window."""

from __future__ import annotations

import pytest

from base_engine import SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from tests.harness.engine_inputs import random_prompts


def _run(model_dir, attention: str, prompts: list[list[int]]) -> dict:
    config = EngineConfig(
        num_kv_blocks=96, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, attention=attention
    )
    engine = LLMEngine(model_dir, config=config)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    finals = {}
    for wave in (prompts[:4], prompts[4:]):  # the second wave hits the first one's prefix blocks
        for prompt in wave:
            engine.add_request(f"r{len(finals) + len(engine.requests)}", prompt, params)
        while engine.has_unfinished:
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.runner.use_paged == (attention == "paged")
    return finals


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_paged_path_matches_bucketed_path(arch: str, make_checkpoint) -> None:
    if arch == "llama":
        model_dir = make_checkpoint(arch="llama")
    else:
        model_dir = make_checkpoint(arch="mistral", seed=4, sliding_window=6)
    prompts = random_prompts(4, 500, 5, 30, seed=3)
    prompts += [p[:12] + q[:5] for p, q in zip(prompts, random_prompts(4, 500, 5, 9, seed=4), strict=True)]
    expected = _run(model_dir, "buckets", prompts)
    got = _run(model_dir, "paged", prompts)
    assert expected.keys() == got.keys()
    for rid, out in expected.items():
        assert got[rid].token_ids == out.token_ids, rid
        for a, b in zip(got[rid].logprobs, out.logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
