"""Cost-aware k (base_engine/speculative/cost.py): with an injected cost table (no timing), a request
gets k = 0 where the measured verify is too dear for its measured acceptance and k > 0 where it is
cheap; the dearer neighbouring batch size is used; the drafter's time counts against its drafts."""

from __future__ import annotations

import pytest

from base_engine.sampling_params import SamplingParams
from base_engine.sequence import Sequence
from base_engine.speculative.adaptive import MIN_COOLDOWN
from base_engine.speculative.cost import CostTable, choose_k, expected_tokens
from base_engine.speculative.ngram import NgramProposer
from base_engine.speculative.speculator import MIN_DRAFT_TIMINGS, RECHECK, Speculator

# t(b, n) for n = 1..5: at b = 1 a 2-token verify costs 1.6 decodes (the CPU figure that made chat lose),
# at b = 4 it is nearly free (weight-bound), at b = 2 in between.
TABLE = CostTable(
    {1: (1.0, 1.6, 2.2, 2.8, 3.4), 2: (1.0, 1.2, 1.4, 1.6, 1.8), 4: (2.0, 2.1, 2.2, 2.3, 2.4)}, off_batch=8
)


def test_expected_tokens_is_the_geometric_prefix() -> None:
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_k_is_zero_where_verify_is_too_dear_for_the_acceptance_and_positive_where_cheap() -> None:
    # b = 1: one draft at alpha 0.3 emits 1.3 tokens for 1.6 decodes; every k loses
    assert choose_k(0.3, 4, 1, TABLE, 0.0) == 0
    # b = 4: the same acceptance pays (1.3 tokens for 1.05 decodes), best with more drafts
    assert choose_k(0.3, 4, 4, TABLE, 0.0) >= 1
    # b = 1 with high acceptance: 2 drafts emit 2.71 tokens for 2.2 decodes (1.23, the best ratio;
    # 1 draft: 1.19, 4 drafts: 4.1 / 3.4 = 1.21)
    assert choose_k(0.9, 4, 1, TABLE, 0.0) == 2
    assert choose_k(0.9, 1, 1, TABLE, 0.0) == 1  # capped by adaptive k / the budget
    assert choose_k(1.0, 4, 8, TABLE, 0.0) == 0  # from off_batch on: never


def test_batch_sizes_between_measured_ones_use_the_dearer_neighbour() -> None:
    assert TABLE.row(3) == TABLE.seconds[4] and TABLE.row(2) == TABLE.seconds[2]
    assert CostTable({1: (1.0, 1.1)}).row(64) == (1.0, 1.1)  # past the last measured: the last
    assert TABLE.row(9) is None


def test_the_drafters_time_counts_against_its_drafts() -> None:
    # b = 4, alpha 0.9: free drafts pay, but a drafter costing a whole step's share per token does not
    assert choose_k(0.9, 4, 4, TABLE, 0.0) == 4
    assert choose_k(0.9, 4, 4, TABLE, draft_seconds=0.5) == 0  # 0.5 s = one request's decode share


def _decoding(request_id: str, tokens: list[int]) -> Sequence:
    seq = Sequence(request_id, tokens[:-1], SamplingParams(max_tokens=64, temperature=0.0))
    seq.output_token_ids = [tokens[-1]]
    seq.num_computed_tokens = len(tokens) - 1  # its last token is uncomputed: it decodes
    return seq


@pytest.mark.parametrize(("alpha", "batch", "drafts"), [(0.3, 1, False), (0.3, 4, True), (0.9, 1, True)])
def test_the_speculator_follows_the_table_per_request(alpha: float, batch: int, drafts: bool) -> None:
    spec = Speculator("ngram", 4, 1024, NgramProposer())
    spec.costs, spec.off_batch = TABLE, TABLE.off_batch
    running = [_decoding(f"r{i}", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]) for i in range(batch)]
    for seq in running:  # its measured acceptance
        state = spec._state(seq)
        state.accepted, state.trials = alpha, 1.0
    spec.propose(running)
    assert all(bool(seq.draft_token_ids) == drafts for seq in running)
    if not drafts:  # too dear: no drafts for a cooldown, then a k = 1 probe re-measures
        state = spec.adaptive["r0"]
        assert state.cooldown == MIN_COOLDOWN
        for _ in range(MIN_COOLDOWN):
            spec.propose(running)
            assert running[0].draft_token_ids == []
        spec.propose(running)
        assert len(running[0].draft_token_ids) == 1


def test_a_drafter_too_dear_even_at_full_acceptance_gets_no_probes() -> None:
    spec = Speculator("ngram", 4, 1024, NgramProposer())
    spec.costs, spec.off_batch = TABLE, TABLE.off_batch
    spec.draft_seconds, spec.num_draft_timings = 2.0, MIN_DRAFT_TIMINGS  # 2 decodes per draft token
    running = [_decoding("r0", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2])]
    drafted = []
    for _ in range(RECHECK):
        spec.propose(running)
        drafted.append(len(running[0].draft_token_ids))
    assert drafted[:-1] == [0] * (RECHECK - 1)  # no probes after any cooldown
    assert drafted[-1] == 1  # the recheck: one draft, to re-time the drafter
    spec.draft_seconds = 0.0  # a cheap drafter: the usual policy again
    spec.propose(running)
    assert spec.num_never_pays == RECHECK


def test_a_new_request_starts_at_the_engines_recent_acceptance() -> None:
    spec = Speculator("ngram", 4, 1024, NgramProposer())
    spec.costs, spec.off_batch = TABLE, TABLE.off_batch
    old = _decoding("old", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2])
    for _ in range(20):
        spec.record(old, 4, 0)  # never accepted
    new = _decoding("new", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2])
    spec.propose([new])
    assert new.draft_token_ids == []  # alpha about 0 from the start: no k = 4 first verify
    assert spec.adaptive["new"].alpha < 0.1
