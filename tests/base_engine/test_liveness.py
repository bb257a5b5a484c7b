"""Liveness as a property: whatever the pool size, prefixes, chunking, adapters, tenants (fair shares of
the batch: yields), aborts and preemptions, every request finishes within a bound of steps, and
afterwards nothing is held (blocks, adapter pins). The property also runs, with fewer draws and no
adapters, on a tiny Qwen3-MoE (tests/harness/families.py: routed experts and a dense layer).

Invariant tests (no leaked block) miss deadlocks; this catches them: before the scheduler rolled back
prefix matches, two waiting requests could hold every free block with nothing running.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.testing import save_random_adapter
from base_engine import LLM, SamplingParams
from base_engine.engine import LLMEngine
from base_engine.model.config import load_model_config
from base_engine.testing.checkpoint import save_random_checkpoint
from tests.harness.engine_inputs import preload_adapters
from tests.harness.families import CHECKPOINTS

BLOCK_SIZE = 4
VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("liveness")
    model_dir = save_random_checkpoint(
        root / "model", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=256,
    )  # fmt: skip
    base = load_model_config(model_dir).base_shapes()
    adapters = [
        save_random_adapter(root / f"a{i}", base, rank=4, modules=["q_proj", "v_proj"], seed=i)
        for i in range(3)
    ]
    return model_dir, adapters


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    sizes = {"hidden_size": 32, "vocab_size": VOCAB, "max_position_embeddings": 256}
    model_dir = save_random_checkpoint(
        tmp_path_factory.mktemp("liveness-moe") / "model", **{**CHECKPOINTS["qwen3-moe"], **sizes}
    )
    return model_dir, []


def test_two_prompts_sharing_a_prefix_finish_in_a_small_pool(tiny) -> None:
    """The measured deadlock: a preempted request re-matched its prefix, could not get the rest and
    kept the matched blocks while waiting, so with nothing running nobody could ever start."""
    llm = LLM(tiny[0], num_kv_blocks=6, block_size=4, max_num_batched_tokens=20, max_num_seqs=4)
    rng = random.Random(0)
    for _ in range(30):
        prefix = [rng.randrange(3, VOCAB) for _ in range(4)]
        prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(2)]
        max_tokens = [rng.randint(1, 24 - len(p)) for p in prompts]
        outs = _run_bounded(llm.engine, prompts, [None, None], max_tokens, aborts={}, max_steps=400)
        assert [None if o is None else len(o.token_ids) for o in outs] == max_tokens


def _scenario() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "seed": st.integers(0, 10_000),
            "num_requests": st.integers(2, 6),
            "chunked": st.booleans(),
            "extra_blocks": st.integers(0, 3),
            "budget": st.integers(8, 32),
            "max_num_seqs": st.integers(1, 4),
            "max_loras": st.integers(1, 2),
            "prefix_caching": st.booleans(),
            "num_aborts": st.integers(0, 2),
        }
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=_scenario())
def test_every_request_finishes_and_nothing_is_held(tiny, sc: dict) -> None:
    _check_liveness(*tiny, sc)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=_scenario())
def test_every_request_finishes_and_nothing_is_held_on_moe(tiny_moe, sc: dict) -> None:
    _check_liveness(*tiny_moe, sc)


def _check_liveness(model_dir: Path, adapter_dirs: list[Path], sc: dict) -> None:
    rng = random.Random(sc["seed"])
    max_model_len = sc["budget"] if not sc["chunked"] else 48
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.choice([4, 8]))] for _ in range(2)]
    prompts, max_tokens, adapters = [], [], []
    tenants = [rng.choice(["a", "b", None]) for _ in range(sc["num_requests"])]
    for _ in range(sc["num_requests"]):
        prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))]
        prompt = (prefix + tail)[: max_model_len - 1]
        prompts.append(prompt)
        max_tokens.append(rng.randint(1, max(1, min(16, max_model_len - len(prompt)))))
        adapters.append(rng.choice([None, *adapter_dirs]))
    # Down to the smallest pool that fits the largest single request.
    largest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    num_blocks = -(-largest // BLOCK_SIZE) + sc["extra_blocks"]
    llm = LLM(
        model_dir,
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=sc["budget"],
        max_num_seqs=sc["max_num_seqs"],
        max_model_len=max_model_len,
        enable_chunked_prefill=sc["chunked"],
        enable_prefix_caching=sc["prefix_caching"],
        max_loras=sc["max_loras"],
        max_cpu_loras=4,
        max_lora_rank=8,
    )
    engine = llm.engine
    preload_adapters(engine, adapter_dirs)
    aborts = {rng.randrange(0, 30): rng.randrange(len(prompts)) for _ in range(sc["num_aborts"])}
    total_tokens = sum(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    outs = _run_bounded(
        engine, prompts, adapters, max_tokens, aborts=aborts, max_steps=20 * total_tokens + 50,
        tenants=tenants,
    )  # fmt: skip
    for i, out in enumerate(outs):
        assert out is not None, f"request {i} never finished"
        if out.finish_reason != "abort":
            assert out.finish_reason == "length" and len(out.token_ids) == max_tokens[i], out
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks outlived their requests"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert engine.lora.cache.num_in_flight() == 0, "adapter pins outlived their requests"
    assert not engine.requests and not engine.has_unfinished


def _run_bounded(
    engine: LLMEngine, prompts, adapters, max_tokens, *, aborts: dict[int, int], max_steps: int, tenants=None
):
    ids = [f"r{i}-{engine.num_steps}" for i in range(len(prompts))]
    tenants = tenants or [None] * len(prompts)
    for rid, prompt, adapter, num, tenant in zip(ids, prompts, adapters, max_tokens, tenants, strict=True):
        ref = None if adapter is None else engine.lora.local_ref(Path(adapter))
        params = SamplingParams(max_tokens=num, ignore_eos=True)
        engine.add_request(rid, prompt, params, adapter=ref, tenant_id=tenant)
    finished: dict[str, object] = {}
    for step in range(max_steps):
        if step in aborts:
            out = engine.abort(ids[aborts[step]])
            if out is not None:
                finished[out.request_id] = out
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == len(ids):
            break
    return [finished.get(rid) for rid in ids]
