"""Sampler against references computed here: float64 loops for penalties and for the allowed sets of
top-k / top-p / min-p, many draws for distributions, fresh generators for seed reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from base_engine.sampler import Sampler, SamplingRow, apply_penalties, inverse_cdf_sample
from base_engine.sampling_params import SamplingParams


def row(params: SamplingParams, prompt: list[int] = (), output: list[int] = ()) -> SamplingRow:  # type: ignore[assignment]
    return SamplingRow(params, list(prompt), list(output), params.seed)


def softmax64(logits: list[float]) -> list[float]:
    m = max(x for x in logits if x != -math.inf)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in logits]
    s = sum(e)
    return [x / s for x in e]


# ---- penalties --------------------------------------------------------------------------------------


def penalize_by_hand(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]):
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        count = output.count(token)
        x -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        out.append(x)
    return out


def test_penalties_follow_the_formula_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    cases = [
        (SamplingParams(repetition_penalty=1.7), [1, 2, 2], [3, 3, 4]),
        (SamplingParams(repetition_penalty=0.6), [0, 5], [5, 11]),
        (SamplingParams(frequency_penalty=0.9), [1, 2], [3, 3, 3, 4]),
        (SamplingParams(presence_penalty=-1.3), [1, 2], [3, 3, 3, 4]),
        (
            SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7),
            [7, 8],
            [7, 9, 9],
        ),
        (SamplingParams(), [1, 2], [3]),  # no penalty: untouched
        (SamplingParams(frequency_penalty=0.5), [1], []),  # nothing generated yet
    ]
    logits = torch.randn(len(cases), vocab, generator=gen, dtype=torch.float64) * 3
    rows = [row(p, prompt, output) for p, prompt, output in cases]
    got = apply_penalties(logits.float(), rows)
    for i, (p, prompt, output) in enumerate(cases):
        expected = penalize_by_hand(logits[i].tolist(), p, prompt, output)
        torch.testing.assert_close(
            got[i].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5
        )


def test_penalties_do_not_touch_the_input_logits() -> None:
    logits = torch.ones(1, 4)
    apply_penalties(logits, [row(SamplingParams(repetition_penalty=2.0), [1], [2])])
    assert torch.equal(logits, torch.ones(1, 4))


def test_out_of_range_token_id_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"got 9, expected 0 <= id < 4"):
        apply_penalties(torch.zeros(1, 4), [row(SamplingParams(frequency_penalty=1.0), [], [9])])


def test_greedy_uses_penalized_logits() -> None:
    # Token 0 is the raw argmax; repeated 3 times with frequency penalty 1 it drops below token 1.
    logits = torch.tensor([[3.0, 1.5, 0.0], [3.0, 1.5, 0.0]])
    rows = [
        row(SamplingParams(temperature=0, frequency_penalty=1.0), [], [0, 0]),
        row(SamplingParams(temperature=0)),
    ]
    assert Sampler(0)(logits, rows).token_ids == [1, 0]


# ---- greedy -----------------------------------------------------------------------------------------


def test_all_greedy_batch_is_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    out = Sampler(0)(logits, [row(SamplingParams(temperature=0)) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.0, seed=i) for i in range(8)
    ]
    out = Sampler(0)(logits, [row(p) for p in params])
    for i in range(1, 8, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"len\(rows\)=2"):
        Sampler()(torch.zeros(3, 5), [row(SamplingParams()), row(SamplingParams())])


# ---- filters and distributions ------------------------------------------------------------------------


def allowed_tokens(logits: list[float], params: SamplingParams) -> tuple[set[int], list[float]]:
    """Allowed set and the renormalized distribution over it, in float64."""
    scaled = [x / params.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    keep = set(order[: params.top_k] if params.top_k > 0 else order)
    probs = softmax64([scaled[t] if t in keep else -math.inf for t in range(len(scaled))])
    mass = 0.0
    nucleus = set()
    for t in order:
        if t in keep and mass < params.top_p:
            nucleus.add(t)
            mass += probs[t]
    probs = softmax64([scaled[t] if t in nucleus else -math.inf for t in range(len(scaled))])
    top = max(probs)
    final = {t for t in nucleus if probs[t] >= params.min_p * top}
    return final, softmax64([scaled[t] if t in final else -math.inf for t in range(len(scaled))])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.2, top_k=6, top_p=0.8, min_p=0.1),
    ],
    ids=["t1", "t0.7", "top_k", "top_p", "min_p", "all"],
)
def test_draws_stay_in_the_allowed_set_and_follow_its_distribution(params: SamplingParams) -> None:
    vocab, num_draws = 12, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    allowed, probs = allowed_tokens(logits.double().tolist(), params)
    # One call with the same row repeated gives num_draws independent draws.
    out = Sampler(seed=4)(logits.expand(num_draws, vocab).contiguous(), [row(params)] * num_draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).tolist()
    assert {t for t in range(vocab) if counts[t]} <= allowed
    for t in range(vocab):
        expected = probs[t] * num_draws
        sigma = math.sqrt(max(expected * (1 - probs[t]), 1.0))
        assert abs(counts[t] - expected) < 5 * sigma, (t, counts[t], expected)


def test_filters_hold_per_row_in_a_mixed_batch() -> None:
    vocab = 40
    gen = torch.Generator().manual_seed(5)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.5),
        SamplingParams(),
        SamplingParams(temperature=0),
    ] * 40
    logits = torch.randn(len(params), vocab, generator=gen) * 2
    out = Sampler(seed=6)(logits, [row(p) for p in params])
    for i, p in enumerate(params):
        allowed, _ = (
            allowed_tokens(logits[i].double().tolist(), p)
            if not p.is_greedy
            else ({int(logits[i].argmax())}, [])
        )
        assert out.token_ids[i] in allowed


def test_tiny_top_p_keeps_the_most_likely_token() -> None:
    # 1 - 1e-9 rounds to 1 in float32: every token's cumulative mass is "<= 1 - p" yet one must stay.
    logits = torch.randn(50, 30, generator=torch.Generator().manual_seed(11))
    out = Sampler(seed=0)(logits, [row(SamplingParams(top_p=1e-9)) for _ in range(50)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_inverse_cdf_never_lands_on_a_zero_probability_token() -> None:
    # Filtered tokens at both ends; uniforms at the extremes of [0, 1).
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.25, 0.2500001, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs, uniforms).tolist() == [1, 3, 3, 3]


# ---- seeds --------------------------------------------------------------------------------------------


def run_steps(
    sampler: Sampler, batches: list[list[SamplingRow]], logits_per_step: list[torch.Tensor], seed: int
):
    """Tokens of the row with ``seed``, given the same logits each step wherever it sits in the batch."""
    tokens = []
    for step, logits_row in enumerate(logits_per_step):
        rows = batches[step % len(batches)]
        position = next(i for i, r in enumerate(rows) if r.params.seed == seed)
        logits = torch.randn(
            len(rows), logits_row.shape[0], generator=torch.Generator().manual_seed(100 + step)
        )
        logits[position] = logits_row
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_batch_and_position() -> None:
    vocab, steps = 64, 25
    logits_per_step = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    alone = run_steps(Sampler(seed=0), [[row(params)]], logits_per_step, 1234)

    target = row(params)
    others = [
        row(SamplingParams(temperature=0.8)),
        row(SamplingParams(seed=7)),
        row(SamplingParams(temperature=0)),
    ]
    batches = [[others[0], target], [target, *others], [others[2], others[1], target, others[0]]]
    in_batches = run_steps(Sampler(seed=99), batches, logits_per_step, 1234)
    assert in_batches == alone

    other_seed = run_steps(
        Sampler(seed=0),
        [[row(SamplingParams(temperature=1.0, top_p=0.95, seed=4321))]],
        logits_per_step,
        4321,
    )
    assert other_seed != alone


def test_sampler_seed_makes_unseeded_rows_reproducible() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(8))
    rows = [row(SamplingParams()) for _ in range(32)]
    assert Sampler(seed=5)(logits, rows).token_ids == Sampler(seed=5)(logits, rows).token_ids
    assert Sampler(seed=5)(logits, rows).token_ids != Sampler(seed=6)(logits, rows).token_ids


# ---- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits_and_include_the_chosen_token() -> None:
    vocab = 30
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9)) * 2
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=5, seed=1),
        SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=20),
    ]
    rows = [row(p, [1, 2, 3], [int(logits[i].argmax())] * 3) for i, p in enumerate(params)]
    out = Sampler(seed=3)(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        entry = out.logprobs[i]
        assert entry is not None
        chosen = out.token_ids[i]
        assert chosen in entry
        top = reference[i].topk(params[i].logprobs).indices.tolist()
        assert set(entry) == {chosen, *top}
        for token, value in entry.items():
            assert value == pytest.approx(float(reference[i, token]), abs=1e-5)
    # The frequency penalty moved row 1 off its raw argmax; its logprob is still the raw one.
    assert out.token_ids[1] != int(logits[1].argmax())
    assert list(out.logprobs[1]) == [out.token_ids[1]]


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    """Counter-based: scoring a position twice, or several positions in one call, draws the same
    token; a generator advancing per call would not (speculative verification relies on this)."""
    vocab = 64
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=77)
    prefixes = [[3] * n for n in range(12)]
    one_at_a_time = [
        Sampler(seed=0)(logits.unsqueeze(0), [row(params, [1, 2], p)]).token_ids[0] for p in prefixes
    ]
    sampler = Sampler(seed=1)
    sampler(logits.unsqueeze(0), [row(params, [1, 2], [])])  # an extra draw first changes nothing
    together = sampler(
        logits.expand(len(prefixes), vocab), [row(params, [1, 2], p) for p in prefixes]
    ).token_ids
    assert together == one_at_a_time
    assert len(set(one_at_a_time)) > 1  # the position moves the draw


def test_position_uniform_is_spread_over_the_unit_interval() -> None:
    from base_engine.seeded_uniform import position_uniform

    u = torch.tensor([position_uniform(seed, pos) for seed in range(20) for pos in range(500)])
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(counts.min()) > 0.9 * len(u) / 10
