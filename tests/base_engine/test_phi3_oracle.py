"""Phi-3 family (Phi3ForCausalLM) against transformers: greedy tokens and top-5 logprobs on tiny random
checkpoints with the family's quirks on (fused qkv/gate_up tensors, partial rotary 0.75 with tied
embeddings as in Phi-4-mini, LongRoPE with prompts past the original context and decodes that cross it,
a sliding window shorter than the prompts), on both attention paths, with and without chunked prefill,
with prefix-cache hits, under preemption and on the CUDA-graph decode buffers; and deterministic mode's
batch invariance across the LongRoPE switch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from base_engine import SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.outputs import RequestOutput
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, PHI3_ORIGINAL

MAX_NEW = 10
VARIANTS = ("phi3-longrope", "phi3-partial-tied", "phi3-window")


def _prompts(variant: str) -> list[list[int]]:
    """Two waves of four; the second shares prefixes with the first (prefix-cache hits)."""
    if variant == "phi3-longrope":
        past, crossing, short, other = (random_prompts(1, 500, n, n, seed=n)[0] for n in (40, 27, 12, 20))
        # past the original at prefill | crosses it while decoding | stays short | short, then crosses
        first = [past, crossing, short, other]
        more = random_prompts(4, 500, 3, 4, seed=5)
        # long prefix hit | short prompt over the long prompt's first blocks | crossing over crossing | short
        second = [past[:36] + more[0], past[:12] + more[1], crossing[:24] + more[2], short[:8] + more[3]]
        return first + second
    first = random_prompts(4, 500, 5, 30, seed=3)
    return first + [p[:16] + q for p, q in zip(first, random_prompts(4, 500, 3, 9, seed=4), strict=True)]


def _run(
    model_dir: Path,
    prompts: list[list[int]],
    *,
    attention: str,
    chunk: int,
    num_kv_blocks: int = 128,
    graphs: bool = False,
) -> list[RequestOutput]:
    config = EngineConfig(
        num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=8,
        attention=attention,
    )  # fmt: skip
    engine = LLMEngine(model_dir, config=config)
    replays = {"n": 0}
    if graphs:  # the CUDA-graph decode path's static buffers, replayed eagerly (no GPU here)
        engine.graphs = engine.make_decode_graphs(capture=False)
        replay = engine.graphs.replay

        def counted(batch):
            replays["n"] += 1
            return replay(batch)

        engine.graphs.replay = counted
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    finals: dict[str, RequestOutput] = {}
    for first in (0, 4):  # the second wave runs after the first: its blocks are cached
        for i in range(first, first + 4):
            engine.add_request(str(i), prompts[i], params)
        while engine.has_unfinished:
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.runner.use_paged == (attention == "paged")
    assert num_kv_blocks >= 128 or engine.scheduler.num_preemptions > 0, "the pool was meant to preempt"
    assert replays["n"] > 0 or not graphs, "no decode step went through the graph buffers"
    return [finals[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def references(make_checkpoint, hf_model_cache) -> Callable[[str], tuple[Path, list, list]]:
    """variant -> (checkpoint, prompts, transformers' (tokens, logprobs) per prompt), computed once."""
    built: dict[str, tuple[Path, list, list]] = {}

    def get(variant: str) -> tuple[Path, list, list]:
        if variant not in built:
            model_dir = make_checkpoint(**CHECKPOINTS[variant])
            prompts = _prompts(variant)
            hf = hf_model_cache(model_dir)
            built[variant] = (model_dir, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts])
        return built[variant]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attention", ["buckets", "paged"])
@pytest.mark.parametrize("chunk", [16, 512], ids=["chunked", "whole"])
def test_phi3_matches_transformers(variant: str, attention: str, chunk: int, references) -> None:
    _check(variant, references, attention=attention, chunk=chunk)


@pytest.mark.slow
def test_phi3_longrope_under_preemption(references) -> None:
    """A pool too small for the wave: preempted requests (long, crossing, short) recompute with the factor
    set their length calls for."""
    _check("phi3-longrope", references, attention="buckets", chunk=16, num_kv_blocks=30)


@pytest.mark.slow
def test_phi3_longrope_on_the_graph_decode_path(references) -> None:
    """Decode-only steps in the CUDA-graph buffers: long-factor rows read the long half of the table."""
    _check("phi3-longrope", references, attention="paged", chunk=16, graphs=True)


def _check(variant: str, references, **run: int | str | bool) -> None:
    model_dir, prompts, refs = references(variant)
    outputs = _run(model_dir, prompts, **run)  # type: ignore[arg-type]
    attention, chunk = run["attention"], run["chunk"]
    compared = 0
    for i, (out, (ref_tokens, ref_lps)) in enumerate(zip(outputs, refs, strict=True)):
        assert out.finish_reason == "length", out.error
        label = f"{variant}/{attention}/{chunk} prompt {i} ({len(prompts[i])} tokens)"
        compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=label)
    assert compared >= 6 * MAX_NEW, "too many near-ties: the check compared almost nothing"
    assert any(o.num_cached_tokens > 0 for o in outputs[4:]), "the second wave must hit the prefix cache"


@pytest.mark.slow
def test_longrope_switch_matters_where_the_test_looks(references) -> None:
    """The past-the-original and crossing prompts really depend on the switch: at the first step with
    more than PHI3_ORIGINAL tokens, transformers' answer with the short factors kept (never switched)
    differs."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, prompts, refs = references("phi3-longrope")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    rotary = hf.model.rotary_emb
    rotary.long_inv_freq = rotary.original_inv_freq.clone()  # what it switches to: the short factors
    for i in (0, 1):  # 40 tokens: long from the prefill; 27 tokens: crosses at decode step 6
        step = max(0, PHI3_ORIGINAL + 1 - len(prompts[i]))
        tokens, never_switched = hf_greedy(hf.eval(), prompts[i], MAX_NEW)
        assert tokens[:step] == refs[i][0][:step]  # the same context up to the switch
        ref_row, row = refs[i][1][step], never_switched[step]
        common = set(ref_row) & set(row)
        assert set(ref_row) != set(row) or max(abs(ref_row[t] - row[t]) for t in common) > 1e-2, i


def _deterministic(prompt: list[int], arrival: int) -> tuple:
    return (
        prompt,
        SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=3, logprobs=3, deterministic=True),
        arrival,
    )


@pytest.mark.slow
def test_deterministic_mode_is_batch_invariant_across_the_longrope_switch(references) -> None:
    """A request that crosses the original context mid-decode answers bitwise the same alone and in a
    batch of other requests (some long from the start, some crossing), chunked, with prefix hits."""
    model_dir, prompts, _ = references("phi3-longrope")
    target = _deterministic(prompts[1], 0)

    def run(reqs: list[tuple], chunk: int) -> RequestOutput:
        config = EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=8)
        engine = LLMEngine(model_dir, config=config)
        pending, finished, step = list(enumerate(reqs)), {}, 0
        while pending or engine.has_unfinished:
            while pending and pending[0][1][2] <= step:
                i, (prompt, params, _) = pending.pop(0)
                engine.add_request(str(i), prompt, params)
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            step += 1
        out = finished[str(len(reqs) - 1)]
        return out.token_ids, out.logprobs

    alone = run([target], 512)
    others = [
        (p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), i % 3)
        for i, p in enumerate(prompts)
    ]
    assert run([*others, (*target[:2], 2)], 16) == alone
    assert run([*others[:3], target], 48) == alone
