"""Block manager and scheduler with fake model outputs (no model): no leak, no double free, ever."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.types import AdapterRef
from base_engine.block_manager import BlockManager
from base_engine.sampling_params import SamplingParams
from base_engine.scheduler import Scheduler
from base_engine.sequence import Sequence, SequenceStatus


def make_seq(rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), **kw)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    holders = [0] * bm.num_blocks
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
        for b in seq.block_table:
            holders[b] += 1
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], f"block {block.block_id} refcount"
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for h, b in bm.hash_to_block.items():
        assert bm.blocks[b].block_hash == h


def fake_step(sched: Scheduler, rng: random.Random) -> list[Sequence]:
    """Advance like the engine would, with random tokens; returns finished sequences."""
    out = sched.schedule()
    finished = []
    for seq in out.overflowed:
        sched.finish(seq, SequenceStatus.FINISHED_ERROR)
        finished.append(seq)
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.commit_full_blocks(item.seq)
        if item.is_sampled:
            item.seq.output_token_ids.append(rng.randrange(8))
            if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
                finished.append(item.seq)
    return finished


ops = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]), st.integers(0, 10**6)), max_size=80
)


@settings(max_examples=60, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    caching=st.booleans(),
)
def test_random_add_step_abort_never_leaks(ops, num_blocks, block_size, budget, caching) -> None:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget)
    rng = random.Random(0)
    live: list[Sequence] = []
    for i, (op, arg) in enumerate(ops):
        r = random.Random(arg)
        if op == "add":
            # Shared prefixes on purpose so prefix caching shares blocks.
            prompt = [1, 2, 3, 4, 5, 6][: r.randint(1, 6)] + [r.randrange(8) for _ in range(r.randint(0, 10))]
            seq = make_seq(f"r{i}", prompt, max_tokens=r.randint(1, 6))
            sched.add(seq)
            live.append(seq)
        elif op == "abort" and live:
            seq = live.pop(arg % len(live))
            sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        else:
            for seq in fake_step(sched, rng):
                live.remove(seq)
        check_invariants(bm, live)
    for seq in list(live):
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    check_invariants(bm, [])
    assert bm.num_used_blocks == 0


def test_prefix_blocks_shared_only_with_same_adapter_and_salt() -> None:
    bm = BlockManager(32, 4)
    prompt = list(range(13))
    ref_a = AdapterRef("t/a@1", "aa", "x")
    ref_b = AdapterRef("t/b@1", "bb", "y")

    def admit(seq: Sequence) -> int:
        hit = bm.match_prefix(seq)
        seq.num_computed_tokens = hit
        bm.allocate(seq, seq.num_tokens - hit)
        seq.num_computed_tokens = seq.num_tokens
        bm.commit_full_blocks(seq)
        return hit

    assert admit(make_seq("1", prompt)) == 0
    assert admit(make_seq("2", prompt)) == 12  # 3 full blocks; the last token is always recomputed
    assert admit(make_seq("3", prompt, adapter=ref_a)) == 0
    assert admit(make_seq("4", prompt, adapter=ref_a)) == 12
    assert admit(make_seq("5", prompt, adapter=ref_b)) == 0
    # Same adapter name, new content hash (a re-upload): no stale reuse.
    assert admit(make_seq("6", prompt, adapter=AdapterRef("t/a@1", "a2", "x"))) == 0
    assert admit(make_seq("7", prompt, cache_salt=b"tenant-1")) == 0
    assert admit(make_seq("8", prompt, cache_salt=b"tenant-1")) == 12
    assert bm.num_prefix_hits == 36


def test_preemption_when_pool_is_small_frees_everything() -> None:
    bm = BlockManager(6, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq(f"s{i}", [i, i + 1, i + 2], max_tokens=6) for i in range(4)]
    for s in seqs:
        sched.add(s)
    rng = random.Random(1)
    done: list[Sequence] = []
    for _ in range(200):
        done += fake_step(sched, rng)
        if not sched.has_unfinished:
            break
    assert len(done) == 4 and all(s.num_output_tokens == 6 for s in done)
    assert sched.num_preemptions > 0
    assert bm.num_used_blocks == 0


def test_request_larger_than_pool_is_finished_not_deadlocked() -> None:
    bm = BlockManager(2, 2)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=3)
    big = make_seq("big", list(range(9)))
    small = make_seq("small", [1, 2], max_tokens=2)
    sched.add(big)
    sched.add(small)
    rng = random.Random(0)
    done: list[Sequence] = []
    for _ in range(50):
        done += fake_step(sched, rng)
        if not sched.has_unfinished:
            break
    assert {s.request_id for s in done} == {"big", "small"}
    assert big.status == SequenceStatus.FINISHED_ERROR and small.status == SequenceStatus.FINISHED_LENGTH
    assert bm.num_used_blocks == 0


def test_chunked_prefill_interleaves_with_decodes() -> None:
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    short = make_seq("short", [1, 2], max_tokens=20)
    sched.add(short)
    rng = random.Random(0)
    fake_step(sched, rng)  # short prefilled, now decoding
    sched.add(make_seq("long", list(range(40)), max_tokens=1))
    for _ in range(5):
        out = sched.schedule()
        ids = {s.seq.request_id: s.num_new_tokens for s in out.scheduled}
        assert ids.get("short") == 1, "the running decode is served every step"
        assert ids.get("long", 0) <= 7
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.is_sampled:
                item.seq.output_token_ids.append(0)


def test_prefix_lookup_of_a_preempted_request_counts_only_its_prompt_tokens() -> None:
    """A recomputed request matches its output tokens too; the hit-rate stats count prompt tokens."""
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    seq = make_seq("p", list(range(10, 19)), max_tokens=8)  # 9 prompt tokens: 2 full blocks
    assert bm.match_prefix(seq) == 0
    seq.output_token_ids += [1, 2, 3, 4, 5, 6, 7]  # 16 tokens: 4 full blocks, all computed
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)
    bm.free_sequence(seq)  # preempted: recomputed from its cached blocks
    seq.num_computed_tokens = 0
    assert bm.match_prefix(seq) == 12  # the 16th token is left to compute
    assert bm.num_prefix_queries == 9 + 9
    assert bm.num_prefix_hits == 0 + 9  # the prompt's 9 tokens were found, not the outputs' 3
    bm.unmatch_prefix(seq)  # an admission rolled back gives back exactly what it counted
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (9, 0)


def test_preempted_requests_count_their_prompt_once_per_admission() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq(f"s{i}", [i, i + 1, i + 2], max_tokens=6) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    rng = random.Random(0)
    for _ in range(200):
        if not sched.has_unfinished:
            break
        fake_step(sched, rng)
    assert not sched.has_unfinished and sched.num_preemptions > 0
    assert bm.num_prefix_queries == sum(3 * (1 + s.num_preemptions) for s in seqs)
    assert 0 <= bm.num_prefix_hits <= bm.num_prefix_queries
