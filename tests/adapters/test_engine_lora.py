"""Multi-LoRA in the engine against PEFT: mixed batches, tiers and eviction, prefix isolation, fail closed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from base_engine import LLM, SamplingParams
from tests.adapters.engine_helpers import ALL_SEVEN, make_adapter, peft_model
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.wait import wait_for

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "qv8": make_adapter(
            tiny_llama_dir, root / "qv8", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        ),
        "all16_rs": make_adapter(
            tiny_llama_dir,
            root / "all16",
            seed=2,
            r=16,
            lora_alpha=8,
            use_rslora=True,
            target_modules=ALL_SEVEN,
        ),
        "patterns": make_adapter(
            tiny_llama_dir,
            root / "pat",
            seed=3,
            r=4,
            lora_alpha=8,
            target_modules=ALL_SEVEN,
            rank_pattern={"o_proj": 12, "layers.1.mlp.down_proj": 2},
            alpha_pattern={"gate_proj": 3.0},
        ),
        "zero": make_adapter(
            tiny_llama_dir, root / "zero", seed=4, zero_b=True, r=8, target_modules=ALL_SEVEN
        ),
    }


@pytest.mark.slow
def test_mixed_batch_matches_peft_one_adapter_at_a_time(tiny_llama_dir, adapters) -> None:
    names = [None, "qv8", "all16_rs", "patterns", "qv8", None, "patterns", "all16_rs"]
    prompts = random_prompts(len(names), 500, 3, 25, seed=31)
    llm = LLM(
        tiny_llama_dir,
        num_kv_blocks=128,
        block_size=4,
        max_loras=4,
        max_lora_rank=16,
        max_num_batched_tokens=40,
    )
    outs = llm.generate(prompts, GREEDY, adapters=[adapters[n] if n else None for n in names])
    compared = 0
    for name in {n for n in names}:
        ref_model = peft_model(tiny_llama_dir, adapters[name] if name else None)
        for prompt, n, out in zip(prompts, names, outs, strict=True):
            if n != name:
                continue
            ref_tokens, ref_lps = hf_greedy(ref_model, prompt, MAX_NEW)
            compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=str(name))
    assert compared >= 4 * MAX_NEW


@pytest.mark.slow
def test_zero_b_adapter_and_base_rows_are_bit_identical(tiny_llama_dir, adapters) -> None:
    prompts = random_prompts(4, 500, 5, 20, seed=32)
    # No prefix caching: a prefix hit changes how (not what) attention computes, so bits could differ.
    llm = LLM(
        tiny_llama_dir,
        num_kv_blocks=128,
        block_size=4,
        max_loras=4,
        max_lora_rank=16,
        enable_prefix_caching=False,
    )
    mixed_refs = [adapters["qv8"], None, adapters["all16_rs"], None]
    llm.generate(prompts, GREEDY, adapters=mixed_refs)  # warm: adapters resident, so scheduling is identical
    base = llm.generate(prompts, GREEDY)
    llm.generate(prompts[:1], GREEDY, adapters=[adapters["zero"]])
    zero = llm.generate(prompts, GREEDY, adapters=[adapters["zero"]] * 4)
    assert [o.logprobs for o in zero] == [o.logprobs for o in base]
    mixed = llm.generate(prompts, GREEDY, adapters=mixed_refs)
    assert mixed[1].logprobs == base[1].logprobs and mixed[3].logprobs == base[3].logprobs
    assert mixed[0].logprobs != base[0].logprobs


def test_more_adapters_than_slots(tiny_llama_dir, tmp_path) -> None:
    dirs = [
        make_adapter(
            tiny_llama_dir, tmp_path / f"a{i}", seed=100 + i, r=4, target_modules=["q_proj", "v_proj"]
        )
        for i in range(12)
    ]
    prompts = random_prompts(24, 500, 3, 12, seed=33)
    picks = [dirs[i % 12] for i in range(24)]
    roomy = LLM(tiny_llama_dir, num_kv_blocks=256, max_loras=12, max_cpu_loras=12, max_lora_rank=8)
    tight = LLM(tiny_llama_dir, num_kv_blocks=256, max_loras=4, max_cpu_loras=6, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = roomy.generate(prompts, params, adapters=picks)
    got = tight.generate(prompts, params, adapters=picks)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = tight.engine.stats().adapters
    assert stats.evictions > 0 and stats.num_gpu <= 4 and stats.num_cpu <= 6
    assert tight.engine.lora.cache.num_in_flight() == 0, "a finished request still pins a slot"


def test_prefix_blocks_not_shared_across_adapters(tiny_llama_dir, adapters) -> None:
    prompt = random_prompts(1, 500, 33, 33, seed=34)[0]
    llm = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=4, max_loras=4, max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate([prompt], params, adapters=[adapters["qv8"]])[0]
    same = llm.generate([prompt], params, adapters=[adapters["qv8"]])[0]
    other = llm.generate([prompt], params, adapters=[adapters["all16_rs"]])[0]
    base = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and same.num_cached_tokens == 32
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_broken_adapter_fails_only_its_requests(tiny_llama_dir, adapters, tmp_path) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["qv8"], corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    no_config = tmp_path / "noconfig"
    shutil.copytree(adapters["qv8"], no_config)
    (no_config / "adapter_config.json").unlink()
    prompts = random_prompts(4, 500, 3, 10, seed=35)
    llm = LLM(tiny_llama_dir, num_kv_blocks=128, max_loras=4, max_lora_rank=16)
    outs = llm.generate(prompts, GREEDY, adapters=[corrupt, adapters["qv8"], no_config, None])
    assert outs[0].finish_reason == "error" and "truncated" in outs[0].error
    assert outs[2].finish_reason == "error" and "adapter_config.json" in outs[2].error
    assert outs[1].finish_reason == "length" and outs[3].finish_reason == "length"
    assert llm.engine.block_manager.num_used_blocks == 0


def test_rank_above_limit_is_refused(tiny_llama_dir, adapters) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=64, max_loras=2, max_lora_rank=8)
    out = llm.generate(["hello"], GREEDY, adapters=[adapters["all16_rs"]])[0]
    assert out.finish_reason == "error" and "rank" in out.error


def test_operator_pin_keeps_adapter_on_device(tiny_llama_dir, adapters) -> None:
    import asyncio

    from base_engine import AsyncEngine, EngineConfig, LLMEngine

    engine = LLMEngine(tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, max_loras=2, max_lora_rank=16))
    lora = engine.lora
    pinned_ref = lora.local_ref(adapters["qv8"])
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        asyncio.run(async_engine.pin_adapter(pinned_ref))
        wait_for(
            lambda: async_engine.adapter_residency().get(pinned_ref.id) == "gpu", 30, what="pinned on GPU"
        )
    finally:
        async_engine.shutdown()
    # Two other adapters through the one remaining slot: the pinned one is never evicted.
    llm_outs = []
    for name in ("all16_rs", "patterns", "all16_rs"):
        engine.add_request(
            name + str(len(llm_outs)), [5, 6, 7], GREEDY, adapter=lora.local_ref(adapters[name])
        )
        while engine.has_unfinished:
            llm_outs += [o for o in engine.step() if o.finished]
    assert all(o.finish_reason == "length" for o in llm_outs)
    assert lora.cache.residency()[pinned_ref.id] == "gpu" and lora.cache.stats.num_evictions >= 1
    lora.unpin(pinned_ref)
    assert pinned_ref.id not in lora.cache.pinned


def test_slow_adapter_load_does_not_stall_other_requests(tiny_llama_dir, adapters) -> None:
    import threading

    from base_engine import EngineConfig, LLMEngine
    from base_engine.lora import local_fetch

    release = threading.Event()

    def slow_fetch(ref):
        release.wait(30)  # the "download" finishes only when the test says so
        return local_fetch(ref)

    engine = LLMEngine(
        tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, max_lora_rank=16), fetch=slow_fetch
    )
    engine.add_request("lora", [5, 6, 7], GREEDY, adapter=engine.lora.local_ref(adapters["qv8"]))
    engine.add_request("base", [8, 9, 10], GREEDY)
    finished = {}
    for _ in range(MAX_NEW + 2):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "base" in finished and finished["base"].finish_reason == "length"
    assert engine.requests["lora"].num_output_tokens == 0, "the adapter request waits while its adapter loads"
    release.set()
    while engine.has_unfinished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["lora"].finish_reason == "length" and len(finished["lora"].token_ids) == MAX_NEW


def test_stats_report_residency_bytes(tiny_llama_dir, adapters) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=64, max_loras=2, max_lora_rank=16)
    llm.generate(["hi"], GREEDY, adapters=[adapters["qv8"]])
    stats = llm.engine.stats().adapters
    size = (adapters["qv8"] / "adapter_model.safetensors").stat().st_size
    assert stats.num_gpu == 1 and 0.9 * size <= stats.gpu_bytes <= size
    assert stats.cpu_bytes == stats.gpu_bytes and stats.gpu_pool_bytes > stats.gpu_bytes
