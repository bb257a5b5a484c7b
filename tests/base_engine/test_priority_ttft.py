"""TTFT of an urgent tenant under saturation by a less urgent one, through the real engine.

What is measured: time to first token in engine steps (the step that yields a request's first token
minus the number of steps already taken when it was added), on the tiny random Llama with the real
scheduler, block manager, LoRA policy and sampler. Why steps and not seconds: this machine is shared
by many processes, so the wall time of one step varies several-fold between runs; a step count is
what the scheduler decides and is exact. One step of a loaded batch costs more than one of an idle
engine, which a step count does not show; benchmarks/ is where seconds are measured.

Saturation: a priority-5 tenant keeps more long requests waiting than `max_num_seqs` and than the KV
pool holds. Claims: (1) a priority-0 tenant's TTFT p99 stays within 1.5x of its unloaded value;
(2) fairness within a level is unchanged: two priority-5 tenants split the generated tokens as they
split them when no urgent tenant is present. Aging is off (`priority_aging_s=0`): it is a wall-clock
rule, tested on its own with a fake clock in test_priority.py.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.sampling_params import SamplingParams

URGENT_PROMPT = 24  # tokens: one step's budget holds the whole prefill beside every decode
LONG_PROMPT = 40
NUM_URGENT = 20
URGENT_EVERY = 6  # steps between two urgent arrivals


def _engine(model_dir: Path) -> LLMEngine:
    # 4 rows, 32 tokens a step, 40 blocks of 4 tokens: 160 KV tokens, far less than the flood needs.
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=40, priority_aging_s=0.0
    )
    return LLMEngine(model_dir, config=config)


def _prompt(i: int, length: int) -> list[int]:
    """Request i's own tokens: no two requests share a prefix-cache block."""
    rng = random.Random(i)
    return [rng.randrange(3, 250) for _ in range(length)]


class _Run:
    """Drives an engine step by step: who was added when, who got its first token when, tokens per tenant."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.added_at: dict[str, int] = {}
        self.first_at: dict[str, int] = {}
        self.tenant: dict[str, str] = {}
        self.tokens: Counter[str] = Counter()

    def add(self, rid: str, tenant: str, priority: int, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(rid, prompt, params, tenant_id=tenant, priority=priority)
        self.added_at[rid] = self.engine.num_steps
        self.tenant[rid] = tenant

    def step(self) -> None:
        for out in self.engine.step():
            if out.new_token_ids:
                self.tokens[self.tenant[out.request_id]] += len(out.new_token_ids)
                self.first_at.setdefault(out.request_id, self.engine.num_steps)

    def ttft(self, rid: str) -> int:
        return self.first_at[rid] - self.added_at[rid]


def _flood(run: _Run, tenants: list[str], num_each: int) -> None:
    for i in range(num_each):
        for t in tenants:
            run.add(f"{t}-{i}", t, 5, _prompt(i, LONG_PROMPT), max_tokens=64)


def _p99(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def _urgent_ttfts(run: _Run, *, steps_between: int) -> list[int]:
    for i in range(NUM_URGENT):
        run.add(f"urgent-{i}", "urgent", 0, _prompt(1000 + i, URGENT_PROMPT), max_tokens=2)
        for _ in range(steps_between):
            run.step()
    urgent = [f"urgent-{i}" for i in range(NUM_URGENT)]
    while not all(rid in run.first_at for rid in urgent):
        run.step()
    return [run.ttft(rid) for rid in urgent]


@pytest.mark.slow
def test_urgent_ttft_p99_under_a_low_priority_flood_stays_within_1_5x_unloaded(
    tiny_llama_dir: Path,
) -> None:
    idle = _Run(_engine(tiny_llama_dir))
    unloaded = _urgent_ttfts(idle, steps_between=URGENT_EVERY)
    assert set(unloaded) == {1}  # the whole prompt fits one step's budget

    loaded = _Run(_engine(tiny_llama_dir))
    _flood(loaded, ["batch"], num_each=24)
    for _ in range(10):  # the flood fills every row and the KV pool before urgent work arrives
        loaded.step()
    sched, blocks = loaded.engine.scheduler, loaded.engine.block_manager
    assert len(sched.waiting) >= 16 and blocks.num_used_blocks >= 0.9 * blocks.num_blocks, (
        len(sched.running), blocks.num_used_blocks,
    )  # fmt: skip
    ttfts = _urgent_ttfts(loaded, steps_between=URGENT_EVERY)
    assert _p99(ttfts) <= 1.5 * _p99(unloaded), ttfts
    assert loaded.engine.scheduler.waiting  # the flood was still queued when the last urgent one ran


@pytest.mark.slow
def test_two_tenants_of_one_level_split_tokens_as_before_when_an_urgent_tenant_arrives(
    tiny_llama_dir: Path,
) -> None:
    def shares(with_urgent: bool) -> tuple[float, Counter[str]]:
        run = _Run(_engine(tiny_llama_dir))
        _flood(run, ["a", "b"], num_each=12)
        for step in range(120):
            if with_urgent and step % URGENT_EVERY == 0:
                run.add(f"urgent-{step}", "urgent", 0, _prompt(2000 + step, URGENT_PROMPT), max_tokens=2)
            run.step()
        return run.tokens["a"] / (run.tokens["a"] + run.tokens["b"]), run.tokens

    plain, plain_tokens = shares(with_urgent=False)
    mixed, mixed_tokens = shares(with_urgent=True)
    assert abs(plain - 0.5) <= 0.1, plain_tokens  # fair within the level, as before priorities
    assert abs(mixed - plain) <= 0.05, (plain_tokens, mixed_tokens)
    assert mixed_tokens["urgent"] > 0
