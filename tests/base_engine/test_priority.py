"""Priority classes in the scheduler (base_engine/priority.py) with fake model outputs: levels are
served strictly, a more urgent level preempts a less urgent one by recompute when KV blocks are
short and takes its batch slots, aging bounds starvation, and with one level in use the schedule is
exactly what it was without priorities (fairness within a level unchanged)."""

from __future__ import annotations

import random
from collections import Counter

from base_engine.block_manager import BlockManager
from base_engine.priority import PriorityPolicy
from base_engine.sampling_params import SamplingParams
from base_engine.scheduler import Scheduler
from base_engine.sequence import Sequence, SequenceStatus
from tests.harness.clock import FakeClock

_NEXT_TOKEN = [1]


def _seq(rid: str, tenant: str, priority: int = 0, max_tokens: int = 50, prompt: int = 5) -> Sequence:
    """A request with its own prompt tokens (no prefix-cache sharing between requests)."""
    start, _NEXT_TOKEN[0] = _NEXT_TOKEN[0], _NEXT_TOKEN[0] + prompt
    tokens = list(range(start, start + prompt))
    seq = Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), tenant_id=tenant)
    seq.priority = priority
    seq.times.arrival = 0.0
    return seq


def _advance(sched: Scheduler) -> tuple[list[str], list[Sequence]]:
    """One step as the engine takes it (token 0 each time): (scheduled ids, finished sequences)."""
    out = sched.schedule()
    done = []
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.commit_full_blocks(item.seq)
        if item.is_sampled:
            item.seq.output_token_ids.append(0)
            if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
                done.append(item.seq)
    return [s.seq.request_id for s in out.scheduled], done


def _scheduler(
    clock: FakeClock, *, blocks: int = 256, max_num_seqs: int = 4, aging_s: float = 30.0
) -> Scheduler:
    return Scheduler(
        BlockManager(blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
        priority=PriorityPolicy(aging_s=aging_s, clock=clock),
    )  # fmt: skip


def test_levels_are_served_strictly_whatever_the_arrival_order() -> None:
    clock = FakeClock(now=0.0)
    sched = _scheduler(clock, max_num_seqs=2)
    for i in range(3):
        sched.add(_seq(f"low{i}", "lo", priority=5))
    sched.add(_seq("mid", "mid", priority=1))
    sched.add(_seq("high", "hi", priority=-3))
    ids, _ = _advance(sched)
    assert ids == ["high", "mid"]  # the two most urgent take the batch; arrival order does not matter


def test_a_more_urgent_tenant_takes_the_batch_slots_of_a_less_urgent_one() -> None:
    clock = FakeClock(now=0.0)
    sched = _scheduler(clock, max_num_seqs=4)
    for i in range(6):
        sched.add(_seq(f"lo{i}", "lo", priority=10))
    _advance(sched)
    assert Counter(s.tenant_id for s in sched.running) == {"lo": 4}
    for i in range(3):
        sched.add(_seq(f"hi{i}", "hi", priority=0, max_tokens=2))
    out = sched.schedule()
    assert {s.seq.request_id for s in out.scheduled} >= {"hi0", "hi1", "hi2"}  # at once, not after lo ends
    assert len(out.yielded) == 3 and all(s.tenant_id == "lo" for s in out.yielded)  # by recompute


def test_kv_memory_short_preempts_the_less_urgent_level_first() -> None:
    clock = FakeClock(now=0.0)
    # 12 blocks of 4 tokens: two 20-token prompts fill 10; a third cannot start without a preemption.
    sched = _scheduler(clock, blocks=12, max_num_seqs=8)
    sched.add(_seq("lo-old", "lo", priority=5, prompt=20))
    sched.add(_seq("mid", "mid", priority=2, prompt=20))
    _advance(sched)
    sched.add(_seq("hi", "hi", priority=0, prompt=20))
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["lo-old"]  # not "mid": least urgent level first
    assert "hi" in [s.seq.request_id for s in out.scheduled]


def test_aging_lets_the_lowest_level_in_after_a_bounded_wait() -> None:
    clock = FakeClock(now=0.0)
    sched = _scheduler(clock, max_num_seqs=2, aging_s=10.0)
    sched.add(_seq("starved", "lo", priority=3, max_tokens=1))
    started_at = None
    for step in range(200):
        clock.advance(0.5)
        while len([s for s in sched.waiting if s.tenant_id == "hi"]) < 3:  # a flood of urgent work
            seq = _seq(f"hi{step}-{len(sched.waiting)}", "hi", priority=0, max_tokens=1)
            seq.times.arrival = clock()
            sched.add(seq)
        ids, _ = _advance(sched)
        if "starved" in ids:
            started_at = clock()
            break
    # 3 levels below the top, one level per 10 s: a peer of the top level after 30 s, first in VTC/FCFS
    # order among its peers soon after (it is the oldest).
    assert started_at is not None and 30.0 <= started_at <= 31.0


def test_no_aging_means_strict_starvation() -> None:
    clock = FakeClock(now=0.0)
    sched = _scheduler(clock, max_num_seqs=1, aging_s=0.0)
    sched.add(_seq("starved", "lo", priority=3, max_tokens=1))
    for step in range(100):
        clock.advance(1.0)
        seq = _seq(f"hi{step}", "hi", priority=0, max_tokens=1)
        seq.times.arrival = clock()
        sched.add(seq)
        ids, _ = _advance(sched)
        assert "starved" not in ids


def _trace(sched: Scheduler, rng: random.Random) -> list[list[str]]:
    trace = []
    for step in range(60):
        if step < 20:
            for _ in range(rng.randint(0, 3)):
                tenant = rng.choice("abc")
                sched.add(
                    _seq(
                        f"{tenant}{step}-{rng.random():.6f}", tenant, priority=7, max_tokens=rng.randint(1, 9)
                    )
                )
        ids, _ = _advance(sched)
        trace.append(ids)
    return trace


def test_one_level_in_use_schedules_exactly_as_without_priorities() -> None:
    """Fairness within a level unchanged: the same workload at one (non-default) priority, aged for
    minutes, gives the very schedule the scheduler gave before priority classes existed."""
    clock = FakeClock(now=0.0)
    clock.advance(600.0)  # every request is 20 aging periods old: aging must not reorder one level
    with_levels = _trace(_scheduler(clock, blocks=64, max_num_seqs=4), random.Random(7))
    plain = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64)
    assert with_levels == _trace(plain, random.Random(7))


def test_fair_shares_hold_among_tenants_of_one_level_below_a_busier_one() -> None:
    clock = FakeClock(now=0.0)
    sched = _scheduler(clock, max_num_seqs=8)
    for i in range(2):
        sched.add(_seq(f"top{i}", "top", priority=0))
    for i in range(10):
        sched.add(_seq(f"x{i}", "x", priority=4))
        sched.add(_seq(f"y{i}", "y", priority=4))
    for _ in range(3):
        _advance(sched)
    # the top level takes what it wants (2), the six slots left split evenly between x and y
    assert Counter(s.tenant_id for s in sched.running) == {"top": 2, "x": 3, "y": 3}
