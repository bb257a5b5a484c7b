"""benchmarks/step_split.py on a tiny model: the split accounts for the whole step, sees every GEMM of a
decode step, and leaves the engine as it found it (no timing asserts)."""

from __future__ import annotations

import pytest
import torch

import base_engine.model.decoder as decoder
from base_engine import EngineConfig, LLMEngine, SamplingParams
from base_engine.testing.checkpoint import save_random_checkpoint
from benchmarks.step_split import CATEGORIES, StepSplit, gemm_inputs, replay_gemms

NUM_LAYERS = 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    root = tmp_path_factory.mktemp("split")
    model_dir = save_random_checkpoint(root / "model", num_hidden_layers=NUM_LAYERS)
    engine = LLMEngine(model_dir, dtype="float32", config=EngineConfig(max_num_seqs=4, num_kv_blocks=32))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [10 + i, 11, 12, 13], params)
    engine.step()  # the prefills: the steps below are decodes
    return engine


def test_split_sums_to_the_step_and_records_each_gemm(engine: LLMEngine) -> None:
    with StepSplit(engine) as split:
        seconds = [split.step() for _ in range(2)]
    assert set(split.seconds) <= set(CATEGORIES)
    # Exclusive times telescope: their sum is the steps' wall time.
    assert sum(split.seconds.values()) == pytest.approx(sum(seconds), rel=1e-6)
    seen = ("gemm", "attention", "norms", "activation", "residual", "sampler", "schedule", "prepare")
    for category in seen:
        assert split.seconds[category] > 0, category
    # qkv, o, gate_up, down per layer, then the LM head on the 3 sampled rows.
    assert len(split.gemms) == 4 * NUM_LAYERS + 1
    assert [c.shape for c in split.gemms[:4]] == [(3, 64), (3, 64), (3, 64), (3, 128)]
    assert split.gemms[-1].weight is engine.runner.model.lm_head.weight and split.gemms[-1].shape == (3, 64)
    assert replay_gemms(split.gemms, gemm_inputs(split.gemms)) > 0


def test_hooks_are_gone_after_the_split(engine: LLMEngine) -> None:
    head, sampler = decoder._head, engine.sampler
    with StepSplit(engine) as split:
        split.step()
    assert decoder._head is head and engine.sampler is sampler
    assert "prepare" not in vars(engine.runner) and "schedule" not in vars(engine.scheduler)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in engine.runner.model.modules())
    before = dict(split.seconds)
    engine.step()  # untimed: the split no longer counts
    assert split.seconds == before
    assert torch.get_num_threads() >= 1
