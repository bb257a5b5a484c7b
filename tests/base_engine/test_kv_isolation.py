"""One request can never reach another's results through the shared KV pool or the shared step.

- Stale bits: every free block is filled with NaN / Inf before every step; a mixed batch (prefill and
  decode, several adapters, prefix hits, block reuse in a small pool) must be bitwise equal to the
  same batch on a clean pool. (A masked attention weight of 0 times a NaN value is NaN: before the
  null block and zero-on-allocate, padded and stale slots leaked into other tenants' rows.)
- Non-finite requests: a request whose values overflow ends with a clear error, publishes no prefix
  blocks, and the other rows of its steps go on unchanged.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from adapters.testing import save_random_adapter
from base_engine import SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.model.config import load_model_config
from base_engine.outputs import NON_FINITE
from base_engine.testing.checkpoint import save_random_checkpoint
from tests.harness.engine_inputs import preload_adapters

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("kv-isolation")
    model_dir = save_random_checkpoint(root / "model", num_hidden_layers=2, max_position_embeddings=256)
    base = load_model_config(model_dir).base_shapes()
    adapters = [
        save_random_adapter(
            root / f"a{i}", base, rank=4, modules=["q_proj", "k_proj", "v_proj", "down_proj"], seed=i, std=0.2
        )  # fmt: skip
        for i in range(3)
    ]
    return model_dir, adapters


def _engine(model_dir: Path, num_kv_blocks: int = 24, attention: str = "buckets") -> LLMEngine:
    config = EngineConfig(
        num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=24, max_num_seqs=6,
        max_loras=3, max_cpu_loras=4, max_lora_rank=8, attention=attention,
    )  # fmt: skip
    return LLMEngine(model_dir, config=config)


def _poison_free_blocks(engine: LLMEngine) -> None:
    """NaN and +/-Inf in every block no request holds and no prefix entry names (stale contents)."""
    bm = engine.block_manager
    ids = [i for i in bm.free if bm.blocks[i].block_hash is None]
    if not ids:
        return
    index = torch.tensor(ids)
    for layer, cache in enumerate(engine.runner.kv_caches):
        value = (math.nan, math.inf, -math.inf)[layer % 3]
        cache.index_fill_(1, index, value)


WAVES = [  # (prompt, adapter index or None, max_tokens); wave 2 shares prefixes with wave 1
    [([5, 6, 7, 8, 9, 10, 11, 12, 13], 0, 6), ([21, 22, 23], None, 9), ([40, 41, 42, 43, 44], 1, 4)],
    [([5, 6, 7, 8, 9, 10, 11, 12, 30, 31], 0, 5), ([40, 41, 42, 43, 50], 1, 7), ([60] * 7, 2, 6)],
    [([21, 22, 23, 24, 25, 26, 27, 28, 29], None, 5), ([5, 6, 7, 8, 70], 2, 8)],
]


def _run_waves(engine: LLMEngine, adapters: list[Path], *, poison: bool) -> dict[str, tuple]:
    results: dict[str, tuple] = {}
    for wave_index, wave in enumerate(WAVES):
        for i, (prompt, adapter, num) in enumerate(wave):
            ref = None if adapter is None else engine.lora.local_ref(adapters[adapter])
            params = SamplingParams(max_tokens=num, ignore_eos=True, logprobs=3)
            engine.add_request(f"w{wave_index}-{i}", prompt, params, adapter=ref)
        for _ in range(3):  # the next wave arrives while this one decodes
            results.update(_step(engine, poison))
    while engine.has_unfinished:
        results.update(_step(engine, poison))
    return results


def _step(engine: LLMEngine, poison: bool) -> dict[str, tuple]:
    if poison:
        _poison_free_blocks(engine)
    return {o.request_id: (o.finish_reason, o.token_ids, o.logprobs) for o in engine.step() if o.finished}


@pytest.mark.parametrize("attention", ["buckets", "paged"])
def test_stale_and_padded_kv_slots_never_change_a_result(setup, attention: str) -> None:
    model_dir, adapters = setup
    clean = _engine(model_dir, attention=attention)
    preload_adapters(clean, adapters)
    expected = _run_waves(clean, adapters, poison=False)
    dirty = _engine(model_dir, attention=attention)
    preload_adapters(dirty, adapters)
    _poison_free_blocks(dirty)
    got = _run_waves(dirty, adapters, poison=True)
    assert clean.block_manager.num_prefix_hits > 0, "the batch must exercise prefix hits"
    assert all(reason == "length" for reason, _, _ in expected.values())
    assert got == expected  # tokens and logprobs, bitwise


def test_small_pool_reuses_poisoned_blocks_bitwise(setup) -> None:
    """A pool so small that blocks are freed and handed to other requests (and preemption happens)."""
    model_dir, adapters = setup
    clean, dirty = _engine(model_dir, num_kv_blocks=8), _engine(model_dir, num_kv_blocks=8)
    for engine in (clean, dirty):
        preload_adapters(engine, adapters)
    expected = _run_waves(clean, adapters, poison=False)
    got = _run_waves(dirty, adapters, poison=True)
    assert clean.scheduler.num_preemptions > 0
    assert got == expected


def _make_evil(engine: LLMEngine, path: Path) -> None:
    """Weights of 1e30: what a hostile upload carried before validation bounded them (the engine must
    still contain whatever overflows)."""
    adapter = engine.lora.cache.host[engine.lora.local_ref(path).id]
    for pair in adapter.weights.values():
        pair.a.fill_(1e30)
        pair.b.fill_(1e30)


def test_non_finite_request_fails_alone_and_publishes_nothing(setup) -> None:
    model_dir, adapters = setup
    evil_dir, good_dirs = adapters[2], adapters[:2]
    control = _engine(model_dir)
    preload_adapters(control, good_dirs)
    engine = _engine(model_dir)
    preload_adapters(engine, adapters)
    _make_evil(engine, evil_dir)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    evil_prompt = [90, 91, 92, 93, 94, 95, 96, 97, 98]

    def submit(target: LLMEngine, with_evil: bool) -> None:
        for i, (prompt, adapter) in enumerate(zip(prompts, [good_dirs[0], None, good_dirs[1]], strict=True)):
            ref = target.lora.local_ref(adapter) if adapter is not None else None
            target.add_request(
                f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2), adapter=ref
            )
        if with_evil:
            ref = target.lora.local_ref(evil_dir)
            target.add_request(
                "evil", evil_prompt, SamplingParams(max_tokens=6, ignore_eos=True), adapter=ref
            )

    submit(control, with_evil=False)
    submit(engine, with_evil=True)
    expected = _drain(control)
    got = _drain(engine)
    evil = got.pop("evil")
    assert evil.finish_reason == "error" and "non-finite" in (evil.error or ""), evil
    assert evil.error_kind == NON_FINITE  # the API's cue for a 400 naming the adapter, not a 500
    assert evil.token_ids == []
    for rid, out in expected.items():
        assert got[rid].token_ids == out.token_ids
        for a, b in zip(got[rid].logprobs, out.logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    # Nothing of the failed request entered the prefix cache: the same prompt again finds no block.
    hits = engine.block_manager.num_prefix_hits
    ref = engine.lora.local_ref(evil_dir)
    engine.add_request("evil-2", evil_prompt, SamplingParams(max_tokens=2, ignore_eos=True), adapter=ref)
    again = _drain(engine)["evil-2"]
    assert again.finish_reason == "error" and engine.block_manager.num_prefix_hits == hits
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _drain(engine: LLMEngine) -> dict:
    finals = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished:
            return finals
    raise AssertionError("engine did not finish")
