"""Adaptive k and the off-switch (base_engine/speculative/adaptive.py, probe.py): a request whose drafts
are never accepted drafts less and less, then only probes now and then; no request is speculated in a
step where the measured number of requests (or more) decode; the tokens never change."""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from pathlib import Path

from base_engine import LLM, SamplingParams
from base_engine.speculative.adaptive import MIN_COOLDOWN, AdaptiveK
from base_engine.speculative.ngram import NgramProposer
from base_engine.speculative.probe import cost_table, measure_costs
from tests.harness.engine_inputs import random_prompts


def test_k_shrinks_to_zero_then_probes_with_a_doubling_cooldown() -> None:
    state, taken = AdaptiveK(4), []
    for _ in range(3 + MIN_COOLDOWN + 1 + 2 * MIN_COOLDOWN + 1):
        k = state.take()
        taken.append(k)
        if k:
            state.update(k, 0)  # never accepted
    assert taken[:3] == [4, 2, 1]
    probe = 3 + MIN_COOLDOWN
    assert taken[3:probe] == [0] * MIN_COOLDOWN and taken[probe] == 1
    assert taken[probe + 1 : probe + 1 + 2 * MIN_COOLDOWN] == [0] * (2 * MIN_COOLDOWN)
    assert taken[-1] == 1


def test_k_grows_back_after_an_accepted_probe() -> None:
    state = AdaptiveK(4, average=0.05, cooldown=1)
    assert state.take() == 0 and state.take() == 1
    state.update(1, 1)
    ks = []
    for _ in range(4):
        k = state.take()
        ks.append(k)
        state.update(k, k)  # all accepted
    assert ks[0] >= 1 and ks == sorted(ks) and ks[-1] == 4


class NeverAccepted:
    """Proposes, after each prefix, a token other than the one the request emits there."""

    def __init__(self, prompt: list[int], reference: list[int], vocab: int) -> None:
        self.prompt, self.reference, self.vocab, self.ks = prompt, reference, vocab, []

    def release(self, request_id: str) -> None:
        pass

    def propose(self, request_id: str, tokens: Tokens[int], k: int) -> list[int]:
        self.ks.append(k)
        done = len(tokens) - len(self.prompt)
        return [(t + 1) % self.vocab for t in self.reference[done : done + k]]


def test_a_never_accepting_drafter_gets_k_shrunk_and_changes_no_token(tiny_llama_dir: Path) -> None:
    prompt = random_prompts(1, 500, 8, 8, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_llama_dir) as llm:
        reference = list(llm.generate([prompt], params)[0].token_ids)
        vocab = llm.engine.model_config.vocab_size
    with LLM(tiny_llama_dir, speculative="ngram", num_speculative_tokens=3, speculative_off_batch=0) as llm:
        drafter = NeverAccepted(prompt, reference, vocab)
        llm.engine.speculator.proposer = drafter
        out = llm.generate([prompt], params)[0]
        counts = llm.engine.stats().spec_decode[""]
    assert list(out.token_ids) == reference
    assert counts.num_accepted_tokens == 0
    assert drafter.ks[:3] == [3, 2, 1]  # shrinks per rejected verify
    assert all(k == 1 for k in drafter.ks[3:]) and 1 <= len(drafter.ks) - 3 <= 3  # rare probes only


def test_the_table_stops_at_the_first_batch_where_no_k_pays_at_high_acceptance() -> None:
    def step_seconds(batch: int, num_new: int) -> float:  # fixed overhead + compute per token
        return 1.0 + batch * num_new

    # verify / decode at b: (1 + b n) / (1 + b); at alpha 0.9, k = 1, 2, 3 drafts emit 1.9, 2.71, 3.44
    # tokens: b = 8 still pays (k=1 costs 17 / 9 = 1.89 decodes), b = 16 does not (k=1: 1.94, k=2: 2.88,
    # k=3: 3.82)
    def row(batch: int) -> tuple[float, ...]:
        return tuple(step_seconds(batch, n) for n in range(1, 5))

    table = cost_table(row, 64)
    assert sorted(table.seconds) == [1, 2, 4, 8, 16] and table.off_batch == 16
    assert table.seconds[4] == tuple(1.0 + 4 * n for n in range(1, 5))
    assert cost_table(row, 4).off_batch is None  # never reached within max_num_seqs
    assert cost_table(lambda b: (1.0,) * 4, 64).off_batch is None  # overhead only: drafts are free
    # a timing dip (noise on a loaded host) never makes a verify cheaper than a shorter one
    assert cost_table(lambda b: (1.0, 1.25, 0.68, 1.22), 1).seconds[1] == (1.0, 1.25, 1.25, 1.25)


class Watching:
    """The n-gram proposer, noting how many running requests decode at each call."""

    def __init__(self, running: list) -> None:
        self.running, self.inner, self.decoding = running, NgramProposer(), []

    def release(self, request_id: str) -> None:
        pass

    def propose(self, request_id: str, tokens: Tokens[int], k: int) -> list[int]:
        self.decoding.append(sum(1 for s in self.running if s.num_uncomputed_tokens == 1))
        return self.inner.propose(request_id, tokens, k)


def _run_watched(model: Path, off_batch: int, num: int) -> tuple[list, list[int], int]:
    prompts = [p * 3 for p in random_prompts(num, 500, 6, 8, seed=6)]
    # Ends one by one: the last ones decode below the threshold.
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 8 * i, ignore_eos=True) for i in range(num)]
    with LLM(model, max_num_seqs=4, speculative="ngram", speculative_off_batch=off_batch) as llm:
        watching = Watching(llm.engine.scheduler.running)
        llm.engine.speculator.proposer = watching
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], watching.decoding, llm.engine.speculator.num_off_steps


def test_no_drafts_in_a_step_with_off_batch_decodes(tiny_llama_dir: Path) -> None:
    tokens, decoding, off_steps = _run_watched(tiny_llama_dir, 3, 4)
    plain, _, _ = _run_watched(tiny_llama_dir, 0, 4)
    assert tokens == plain
    assert off_steps > 0 and decoding and max(decoding) < 3  # proposed only below the threshold


def test_the_threshold_is_measured_at_start_and_switches_off_above_it(tiny_llama_dir: Path) -> None:
    with LLM(tiny_llama_dir, max_num_seqs=4, speculative="ngram") as llm:
        engine = llm.engine
        measured = engine.speculator.off_batch
        assert engine.speculator.costs is not None and engine.speculator.costs.off_batch == measured
        again = measure_costs(engine.runner, 4, 4, engine.max_model_len)
    assert measured is None or 1 <= measured <= 4
    assert again.off_batch is None or 1 <= again.off_batch <= 4
    assert all(len(row) == 5 and min(row) > 0 for row in again.seconds.values())
    if measured is not None:  # at and above it, no request of the step is speculated
        _, decoding, off_steps = _run_watched(tiny_llama_dir, measured, 4)
        assert off_steps > 0 and all(d < measured for d in decoding)
