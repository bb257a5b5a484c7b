"""Speculation is lossless as a property: random mixed batches of base rows and rows with up to 8
adapters, prompts with and without repeats, both proposers (n-gram; a draft model: the target itself,
acceptance about 1, and another random model, about 0), greedy and seeded temperature-1 sampling, a
tiny KV pool (preemption), aborts and shared prefixes (prefix-cache hits) -> every request's tokens
(and logprobs within 1e-4) equal the same request run alone without speculation; an aborted request's
tokens are a prefix of its lone run's. Afterwards no block is held and every hash published to the
prefix cache is a chain over tokens some request really has (no rejected draft is ever published).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.testing import save_random_adapter
from base_engine import LLM, SamplingParams
from base_engine.block_manager import chain_hash, prefix_root
from base_engine.engine import LLMEngine
from base_engine.model.config import load_model_config
from base_engine.outputs import RequestOutput
from base_engine.sequence import Sequence
from base_engine.testing.checkpoint import save_random_checkpoint
from tests.harness.engine_inputs import preload_adapters

BLOCK_SIZE = 4
VOCAB = 512
NUM_ADAPTERS = 8
MAX_TOKENS = 16
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "init_scale": 0.8,
}  # fmt: skip (smaller weights: outputs loop more, drafts get accepted)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], Path]:
    root = tmp_path_factory.mktemp("spec-property")
    model_dir = save_random_checkpoint(root / "model", **TINY)
    other = save_random_checkpoint(root / "other", **{**TINY, "seed": 1})  # a drafter that rarely agrees
    base = load_model_config(model_dir).base_shapes()
    adapters = [
        save_random_adapter(root / f"a{i}", base, rank=4, modules=["q_proj", "v_proj"], seed=i, std=0.1)
        for i in range(NUM_ADAPTERS)
    ]
    return model_dir, adapters, other


@pytest.fixture(scope="module")
def reference(tiny) -> LLMEngine:
    """Without speculation, one request at a time (a roomy pool, no prefix cache)."""
    model_dir, adapters, _ = tiny
    llm = LLM(model_dir, block_size=BLOCK_SIZE, num_kv_blocks=256, enable_prefix_caching=False,
              max_loras=NUM_ADAPTERS, max_cpu_loras=NUM_ADAPTERS, max_lora_rank=8)  # fmt: skip
    preload_adapters(llm.engine, adapters)
    yield llm.engine
    llm.close()


def _scenario() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "seed": st.integers(0, 10_000),
            "num_requests": st.integers(2, 6),
            "num_adapters": st.integers(0, NUM_ADAPTERS),
            "k": st.integers(1, 4),
            "extra_blocks": st.integers(0, 4),
            "budget": st.sampled_from([8, 16, 64]),
            "max_num_seqs": st.integers(1, 4),
            "prefix_caching": st.booleans(),
            "num_aborts": st.integers(0, 2),
            "off_batch": st.sampled_from([0, 2, 3]),  # 0: never switched off (not measured: deterministic)
        }
    )


def _requests(sc: dict, adapters: list[Path]) -> list[tuple[list[int], Path | None, SamplingParams]]:
    rng = random.Random(sc["seed"])
    prefix = [rng.randrange(3, VOCAB) for _ in range(8)]  # shared: prefix-cache hits
    used = adapters[: sc["num_adapters"]]
    out = []
    for _ in range(sc["num_requests"]):
        body = [rng.randrange(3, rng.choice([40, VOCAB])) for _ in range(rng.randint(2, 8))]
        body = body * rng.choice([1, 2, 3])  # repeats: the n-gram proposer finds matches
        prompt = (prefix if rng.random() < 0.5 else []) + body
        adapter = rng.choice([None, *used])
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(
                temperature=1.0, max_tokens=MAX_TOKENS, seed=rng.randrange(1 << 20), ignore_eos=True
            )
        out.append((prompt, adapter, params))
    return out


def run_alone(
    engine: LLMEngine, prompt: list[int], adapter: Path | None, params: SamplingParams
) -> RequestOutput:
    rid = f"alone-{engine.num_steps}"
    ref = None if adapter is None else engine.lora.local_ref(adapter)
    engine.add_request(rid, prompt, params, adapter=ref)
    while True:
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out


def run_mixed(
    engine: LLMEngine, requests, aborts: dict[int, int]
) -> tuple[list[RequestOutput | None], list[Sequence]]:
    ids = [f"r{i}-{engine.num_steps}" for i in range(len(requests))]
    seqs = []
    for rid, (prompt, adapter, params) in zip(ids, requests, strict=True):
        ref = None if adapter is None else engine.lora.local_ref(adapter)
        engine.add_request(rid, prompt, params, adapter=ref)
        seqs.append(engine.requests[rid])
    finished: dict[str, RequestOutput] = {}
    for step in range(2000):
        if step in aborts and (out := engine.abort(ids[aborts[step]])) is not None:
            finished[out.request_id] = out
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == len(ids):
            break
    return [finished.get(rid) for rid in ids], seqs


def check_nothing_held(engine: LLMEngine, seqs: list[Sequence]) -> None:
    """The liveness test's checks, and every published hash is a chain over real tokens."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks outlived their requests"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert engine.lora.cache.num_in_flight() == 0, "adapter pins outlived their requests"
    assert not engine.requests and not engine.has_unfinished
    real: set[bytes] = set()
    for seq in seqs:
        tokens, parent = seq.prompt_token_ids + seq.output_token_ids, prefix_root(seq)
        for i in range(len(tokens) // BLOCK_SIZE):
            parent = chain_hash(parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            real.add(parent)
    for block_hash, block_id in bm.hash_to_block.items():
        assert block_hash in real, f"block {block_id} was published with tokens no request has"
        assert bm.blocks[block_id].block_hash == block_hash


def check_lossless(mixed: list[RequestOutput | None], alone: list[RequestOutput]) -> None:
    for i, (m, a) in enumerate(zip(mixed, alone, strict=True)):
        assert m is not None, f"request {i} never finished"
        if m.finish_reason == "abort":
            assert m.token_ids == a.token_ids[: len(m.token_ids)], f"request {i} (aborted)"
            continue
        assert m.token_ids == a.token_ids, f"request {i}"
        for la, lb in zip(a.logprobs or [], m.logprobs or [], strict=True):
            assert la.keys() == lb.keys(), f"request {i}"
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la), f"request {i}"


def mixed_engine(model_dir: Path, sc: dict, requests, speculative: str) -> LLMEngine:
    largest = max(len(p) + q.max_tokens for p, _, q in requests)
    llm = LLM(
        model_dir,
        num_kv_blocks=-(-largest // BLOCK_SIZE) + sc["extra_blocks"],  # down to the largest request
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=sc["budget"],
        max_num_seqs=sc["max_num_seqs"],
        enable_prefix_caching=sc["prefix_caching"],
        max_loras=max(1, min(sc["num_adapters"], 4)),
        max_cpu_loras=NUM_ADAPTERS,
        max_lora_rank=8,
        speculative=speculative,
        num_speculative_tokens=sc["k"],
        speculative_off_batch=sc["off_batch"],
    )
    return llm.engine


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=_scenario())
@pytest.mark.parametrize("proposer", ["ngram", "draft:self", "draft:other"])
def test_speculation_is_lossless_in_mixed_batches(tiny, reference, proposer: str, sc: dict) -> None:
    """n-gram; the target drafting for itself (acceptance about 1); another random model (about 0)."""
    model_dir, adapter_dirs, other = tiny
    requests = _requests(sc, adapter_dirs)
    alone = [run_alone(reference, *r) for r in requests]
    method = {"draft:self": f"draft:{model_dir}", "draft:other": f"draft:{other}"}.get(proposer, proposer)
    engine = mixed_engine(model_dir, sc, requests, method)
    try:
        preload_adapters(engine, adapter_dirs[: sc["num_adapters"]])
        rng = random.Random(sc["seed"] + 1)
        aborts = {rng.randrange(0, 20): rng.randrange(len(requests)) for _ in range(sc["num_aborts"])}
        mixed, seqs = run_mixed(engine, requests, aborts)
        check_lossless(mixed, alone)
        check_nothing_held(engine, seqs)
    finally:
        engine.close()
