"""The CUDA-graph decode path without a GPU: the same static buffers, padding and in-place refresh,
run eagerly (capture=False). Decode steps whose batch size and adapter set change from step to step
give the tokens and logprobs of the ordinary path, and prefill steps fall back to it; for every family
(tests/harness/families.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.testing import save_random_adapter
from base_engine import SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.model.config import load_model_config
from base_engine.runner.cuda_graphs import bucket_sizes
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, FAMILIES


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


# Every family; Gemma's windowed layers' metadata (AttentionMetadata.sliding) shares the graph's buffers.
@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, make_checkpoint) -> Path:
    return make_checkpoint(**CHECKPOINTS[request.param])


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = load_model_config(model_dir).base_shapes()
    root = tmp_path_factory.mktemp("graphs")
    return [
        save_random_adapter(root / f"a{i}", base, rank=4, seed=i, std=0.2, modules=base.projections)
        for i in range(3)
    ]


def _run(model_dir: Path, adapters: list[Path], *, graphs: bool) -> tuple[dict, int]:
    config = EngineConfig(num_kv_blocks=128, block_size=4, max_num_seqs=6, max_loras=3, attention="paged")
    engine = LLMEngine(model_dir, config=config)
    cache = engine.lora.cache
    for path in adapters:  # loaded up front: both runs then schedule the same steps
        cache.request_load(engine.lora.local_ref(path))
    for pending in list(cache.pending.values()):
        pending.future.result(timeout=30)
    cache.poll()
    replays = {"n": 0}
    if graphs:
        engine.graphs = engine.make_decode_graphs(capture=False)
        real = engine.graphs.replay

        def counting(batch):
            replays["n"] += 1
            return real(batch)

        engine.graphs.replay = counting
    prompts = random_prompts(6, 500, 3, 14, seed=11)
    plan = [(None, 9), (0, 4), (1, 12), (0, 7), (2, 3), (None, 10)]  # (adapter, max_tokens)
    finals = {}
    for i, (prompt, (adapter, num)) in enumerate(zip(prompts, plan, strict=True)):
        ref = None if adapter is None else engine.lora.local_ref(adapters[adapter])
        params = SamplingParams(max_tokens=num, ignore_eos=True, logprobs=2)
        engine.add_request(f"r{i}", prompt, params, adapter=ref)
        for _ in range(2):  # arrivals interleave with decode-only steps of various sizes and sets
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals, replays["n"]


def test_graph_buffers_replay_like_the_eager_path(model_dir: Path, adapters: list[Path]) -> None:
    expected, _ = _run(model_dir, adapters, graphs=False)
    got, num_replays = _run(model_dir, adapters, graphs=True)
    assert num_replays >= 5
    assert expected.keys() == got.keys()
    for rid, out in expected.items():
        assert got[rid].token_ids == out.token_ids, rid
        for a, b in zip(got[rid].logprobs, out.logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
