"""Engine behaviour on a tiny Llama: batch independence, preemption, chunked prefill, prefix caching,
stop conditions and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from base_engine import LLM, SamplingParams
from tests.base_engine.oracle import assert_same_generation
from tests.harness.engine_inputs import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path):
    """Each prompt alone, with a roomy pool: the outputs every other configuration must reproduce."""
    llm = LLM(tiny_llama_dir, num_kv_blocks=256, block_size=4, enable_prefix_caching=False)
    prompts = random_prompts(16, 500, 1, 40, seed=7)
    return prompts, [llm.generate([p], GREEDY)[0] for p in prompts]


def assert_all_same(reference_outputs, outputs, label: str) -> None:
    for i, (a, b) in enumerate(zip(reference_outputs, outputs, strict=True)):
        assert_same_generation(a.token_ids, a.logprobs, b.token_ids, b.logprobs, label=f"{label} #{i}")


def test_batch_of_16_mixed_lengths_equals_alone(tiny_llama_dir, reference) -> None:
    prompts, alone = reference
    llm = LLM(tiny_llama_dir, num_kv_blocks=256, block_size=4, max_num_batched_tokens=64)
    assert_all_same(alone, llm.generate(prompts, GREEDY), "batched")


def test_small_pool_preempts_and_gives_same_outputs(tiny_llama_dir, reference) -> None:
    prompts, alone = reference
    llm = LLM(tiny_llama_dir, num_kv_blocks=24, block_size=4, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, GREEDY)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "pool of 96 tokens for 16 prompts must preempt"
    assert_all_same(alone, outputs, "preempted")
    assert stats.num_kv_blocks_used == 0
    assert all(b.ref_count == 0 for b in llm.engine.block_manager.blocks)


@pytest.mark.parametrize("chunked,budget", [(True, 5), (True, 1), (False, 2048)])
def test_chunked_prefill_changes_no_output(tiny_llama_dir, reference, chunked, budget) -> None:
    prompts, alone = reference
    llm = LLM(
        tiny_llama_dir,
        num_kv_blocks=256,
        block_size=4,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
    )
    assert_all_same(alone[:6], llm.generate(prompts[:6], GREEDY), f"chunked={chunked} budget={budget}")


def test_prefix_caching_hits_and_changes_no_output(tiny_llama_dir) -> None:
    shared = random_prompts(1, 500, 37, 37, seed=9)[0]
    prompts = [shared + tail for tail in random_prompts(3, 500, 2, 6, seed=10)]
    cold = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=4, enable_prefix_caching=False)
    warm = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=4)
    expected = [cold.generate([p], GREEDY)[0] for p in prompts]
    got = [warm.generate([p], GREEDY)[0] for p in prompts]
    assert got[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 36 for o in got[1:]), [o.num_cached_tokens for o in got]
    stats = warm.engine.stats()
    assert stats.num_prefix_hits == 72 and stats.num_prefix_queries >= stats.num_prefix_hits
    assert_all_same(expected, got, "prefix-cached")


def test_stop_conditions(tiny_llama_dir) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=64)
    prompt = random_prompts(1, 500, 5, 5, seed=11)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))[
        0
    ]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]
    text = free.text
    if len(text.strip()) >= 6:
        needle = text[3:6]
        by_str = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=[needle]))[0]
        assert by_str.finish_reason == "stop" and needle not in by_str.text
        assert text.startswith(by_str.text)


def test_eos_stops_unless_ignored(tiny_llama_dir) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=64)
    prompt = random_prompts(1, 500, 5, 5, seed=12)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    eos_id = free.token_ids[2]
    llm.engine.eos_token_ids = frozenset({eos_id})
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos_id
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids


def test_seed_gives_same_sample_alone_and_in_batch(tiny_llama_dir) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=128)
    prompts = random_prompts(5, 500, 3, 20, seed=13)
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=42, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0]
    batch = llm.generate(
        prompts,
        [SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)] * 2
        + [seeded]
        + [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * 2,
    )
    mixed = llm.generate([prompts[3], prompts[0]], [SamplingParams(max_tokens=3), seeded])
    assert batch[2].token_ids != [] and llm.generate([prompts[2]], seeded)[0].token_ids == batch[2].token_ids
    assert mixed[1].token_ids == alone.token_ids


def test_bad_input_is_a_clear_error(tiny_llama_dir, tmp_path) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=16, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len 32"):
        llm.generate([list(range(3, 40))], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(tiny_llama_dir, max_num_seq=4)


def test_unknown_architecture_and_missing_tensor(tiny_llama_dir, tmp_path) -> None:
    bad_arch = tmp_path / "arch"
    shutil.copytree(tiny_llama_dir, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        LLM(bad_arch)
    missing = tmp_path / "missing"
    shutil.copytree(tiny_llama_dir, missing)
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(missing)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(tiny_llama_dir, dtype) -> None:
    prompts = random_prompts(3, 500, 4, 16, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    full = LLM(tiny_llama_dir, num_kv_blocks=64).generate(prompts, params)
    half = LLM(tiny_llama_dir, num_kv_blocks=64, dtype=dtype).generate(prompts, params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in half)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(full, half, strict=True)) >= 2


def test_vtc_lets_a_light_tenant_overtake_a_heavy_backlog(tiny_llama_dir) -> None:
    from base_engine import EngineConfig, LLMEngine

    engine = LLMEngine(tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, max_num_seqs=2, max_wait_s=60))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(8, 500, 4, 8, seed=15)
    for i in range(6):
        engine.add_request(f"A{i}", prompts[i], params, tenant_id="A")
    engine.step()
    engine.step()
    for i in range(2):
        engine.add_request(f"B{i}", prompts[6 + i], params, tenant_id="B")
    order = []
    while engine.has_unfinished:
        order += [o.request_id for o in engine.step() if o.finished]
    assert order.index("B1") < order.index("A4"), order  # plain FCFS would finish every A first
    assert order.index("B0") < order.index("A3"), order


def test_a_tenant_over_its_share_yields_and_its_answers_stay_the_same(tiny_llama_dir, reference) -> None:
    """Issue 28 item 11 in the engine: B's requests start at the next step although A's fill the batch;
    A's yielded requests are recomputed and finish with the tokens they would have had alone."""
    from base_engine import EngineConfig, LLMEngine

    prompts, alone = reference
    config = EngineConfig(num_kv_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=256)
    engine = LLMEngine(tiny_llama_dir, config=config)
    for i in range(12):
        engine.add_request(f"A{i}", prompts[i], GREEDY, tenant_id="A")
    engine.step()
    engine.step()
    for i in range(12, 16):
        engine.add_request(f"B{i}", prompts[i], GREEDY, tenant_id="B")
    first = {o.request_id for o in engine.step() if o.new_token_ids}
    assert {"B12", "B13"} <= first  # B's share of the batch (2 of 4) starts in the very next step
    assert engine.stats().num_preemptions == 2
    outputs = {}
    while engine.has_unfinished:
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
    got = [outputs[f"A{i}"] if i < 12 else outputs[f"B{i}"] for i in range(16)]
    assert_all_same(alone, got, "yielded")
