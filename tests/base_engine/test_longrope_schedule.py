"""LongRoPE in the scheduler, without a model: a sequence runs with the long factors iff it holds more
than the original context's tokens; the decode that crosses the boundary recomputes the whole sequence
(as transformers' Phi3 generate drops its cache there), and prefix-cache keys keep the factor sets apart."""

from __future__ import annotations

from base_engine.block_manager import BlockManager
from base_engine.sampling_params import SamplingParams
from base_engine.scheduler import ScheduledSeq, Scheduler
from base_engine.sequence import Sequence

ORIGINAL = 8


def _scheduler(long_factor_after: int | None = ORIGINAL, budget: int = 64) -> Scheduler:
    return Scheduler(
        BlockManager(64, 2),
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        long_factor_after=long_factor_after,
    )


def _step(sched: Scheduler) -> list[ScheduledSeq]:
    """One engine step's bookkeeping: computed tokens, committed blocks, a token for each sampled row."""
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.commit_full_blocks(item.seq)
        if item.is_sampled:
            item.seq.output_token_ids.append(7)
    return out.scheduled


def _seq(rid: str, prompt: list[int]) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=20))


def test_the_crossing_decode_recomputes_the_whole_sequence_long() -> None:
    sched = _scheduler()
    seq = _seq("a", list(range(10, 16)))  # 6 prompt tokens
    sched.add(seq)
    steps = [[(i.start, i.num_new_tokens, i.seq.is_long_rope) for i in _step(sched)] for _ in range(4)]
    # prefill 6 (short) | decode at 6 (7 tokens) | decode at 7 (8 tokens) | 9 tokens: everything again, long
    assert steps == [[(0, 6, False)], [(6, 1, False)], [(7, 1, False)], [(0, 9, True)]]
    assert [(i.start, i.num_new_tokens) for i in _step(sched)] == [(9, 1)]  # then plain long decodes


def test_a_prompt_past_the_original_is_long_from_its_first_chunk() -> None:
    sched = _scheduler(budget=4)
    seq = _seq("a", list(range(10, 20)))  # 10 > 8 tokens
    sched.add(seq)
    chunks = [[(i.start, i.num_new_tokens, i.seq.is_long_rope) for i in _step(sched)] for _ in range(4)]
    assert chunks == [[(0, 4, True)], [(4, 4, True)], [(8, 2, True)], [(10, 1, True)]]


def test_prefix_blocks_are_shared_only_within_a_factor_set() -> None:
    sched = _scheduler()
    crossing = _seq("crossing", list(range(10, 16)))
    sched.add(crossing)
    for _ in range(4):
        _step(sched)  # its short blocks stay cached after the recompute, next to its long ones
    sched.finish(crossing, crossing.status.FINISHED_LENGTH)
    short = _seq("short", list(range(10, 16)) + [1])  # 7 tokens: short, hits the short blocks
    long = _seq("long", list(range(10, 16)) + [7, 7, 7, 1])  # 10 tokens: long, hits the long blocks
    for seq in (short, long):
        sched.add(seq)
    _step(sched)
    assert short.num_cached_tokens == 6 and not short.is_long_rope
    assert long.num_cached_tokens == 8 and long.is_long_rope  # the crossing one's long blocks of 9 tokens
    fresh = _seq("fresh", [1] * 12)
    sched.add(fresh)
    _step(sched)
    assert fresh.num_cached_tokens == 0


def test_without_longrope_nothing_restarts() -> None:
    sched = _scheduler(long_factor_after=None)
    sched.add(_seq("a", list(range(10, 16))))
    starts = [[(i.start, i.num_new_tokens, i.seq.is_long_rope) for i in _step(sched)][0] for _ in range(6)]
    assert starts == [(0, 6, False)] + [(p, 1, False) for p in range(6, 11)]
