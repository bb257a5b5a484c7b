"""Fair shares of the running batch (base_engine/fair_share.py) on the scheduler with fake model outputs:
a tenant whose sequences fill the batch yields to another that waits, nobody starves, nothing leaks.
The same in the engine with identical answers: tests/base_engine/test_engine.py."""

from __future__ import annotations

import random
from collections import Counter

from base_engine.block_manager import BlockManager
from base_engine.fair_share import fair_shares
from base_engine.sampling_params import SamplingParams
from base_engine.scheduler import Scheduler
from base_engine.sequence import Sequence, SequenceStatus


def _seq(rid: str, tenant: str, max_tokens: int = 50) -> Sequence:
    return Sequence(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens), tenant_id=tenant)


def _advance(sched: Scheduler) -> list[Sequence]:
    """One step as the engine takes it (token 0 each time); the sequences it finished."""
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
    return done


def _running(sched: Scheduler) -> Counter[str | None]:
    return Counter(s.tenant_id for s in sched.running)


def test_shares_are_max_min_fair() -> None:
    assert fair_shares(Counter({"x": 8}), Counter({"x": 2, "y": 3}), 8) == {"x": 5, "y": 3}
    assert fair_shares(Counter({"x": 4, "y": 4}), Counter({"z": 9}), 8) == {"x": 3, "y": 3, "z": 2}
    assert fair_shares(Counter({"x": 6}), Counter({"y": 2}), 8) is None  # everyone fits
    assert fair_shares(Counter({"x": 8}), Counter({"x": 30}), 8) is None  # a lone tenant takes it all
    shares = fair_shares(Counter({"x": 64}), Counter({"y": 5, "z": 100}), 64)
    assert shares == {"y": 5, "x": 30, "z": 29} and sum(shares.values()) == 64


def test_a_tenant_filling_the_batch_yields_at_the_next_step() -> None:
    """Issue 28 item 11: with X's long streams running, Y's requests waited for them to end."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(10):
        sched.add(_seq(f"x{i}", "x"))
    _advance(sched)
    _advance(sched)
    assert _running(sched) == {"x": 8}
    for i in range(3):
        sched.add(_seq(f"y{i}", "y", max_tokens=2))
    out = sched.schedule()
    assert {s.seq.request_id for s in out.scheduled} >= {"y0", "y1", "y2"}  # first tokens now
    assert [s.request_id for s in out.yielded] == ["x7", "x6", "x5"]  # X's newest, recomputed later
    assert _running(sched) == {"x": 5, "y": 3} and sched.num_preemptions == 3


def test_nobody_starves_and_nothing_leaks_while_tenants_flood() -> None:
    rng = random.Random(0)
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=16)
    added: list[Sequence] = []
    finished: list[Sequence] = []
    for step in range(3000):
        if step < 400 and rng.random() < 0.5:
            seq = _seq(f"s{step}", rng.choice("xxxyz"), max_tokens=rng.randint(1, 30))
            added.append(seq)
            sched.add(seq)
        finished += _advance(sched)
        if step % 7 == 0:  # every tenant that waits runs at least its share
            running, waiting = _running(sched), {s.tenant_id for s in sched.waiting}
            if len(sched.running) == sched.max_num_seqs:
                assert all(running[t] >= 6 // 3 for t in waiting), (running, waiting)
        if step >= 400 and not sched.has_unfinished:
            break
    assert len(finished) == len(added) and all(s.num_output_tokens == s.params.max_tokens for s in added)
    assert sched.num_preemptions > 0 and bm.num_used_blocks == 0
