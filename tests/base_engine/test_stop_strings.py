"""Stop strings through one automaton (base_engine/stop_strings.py): the same matches as searching each
stop string, and a cost per character that does not grow with their number (issue 28 item 9: 10,000
stop strings in one request slowed every co-batched request 30x)."""

from __future__ import annotations

import random
import time

from hypothesis import given
from hypothesis import strategies as st

from base_engine.detokenizer import Detokenizer
from base_engine.postprocess import Stop, check_stop
from base_engine.sampling_params import SamplingParams
from base_engine.sequence import Sequence, SequenceStatus
from base_engine.stop_strings import StopAutomaton

_TEXT = st.text(alphabet="abc", max_size=40)
_STOPS = st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=8)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The oracle: every stop searched on its own; the one ending first, the longest of those."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return None
    end, _, stop = min(found)
    return end, stop


def _longest_held(text: str, stops: list[str]) -> int:
    return max((n for n in range(1, len(text) + 1) for s in stops if s.startswith(text[-n:])), default=0)


@given(text=_TEXT, stops=_STOPS, cuts=st.lists(st.integers(0, 40), max_size=4))
def test_matches_and_holds_like_searching_each_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    automaton, state = StopAutomaton(tuple(stops)), 0
    pieces, start = [], 0
    for cut in sorted(cuts) + [len(text)]:
        pieces.append(text[start : max(start, cut)])
        start = max(start, cut)
    read, result = 0, None
    for piece in pieces:  # fed in pieces, as tokens bring it
        state, match = automaton.feed(state, piece)
        if match is not None:
            result = (read + match.end, match.stop)
            break
        read += len(piece)
        assert automaton.num_held(state) == _longest_held(text[:read], stops)
    assert result == _first_stop(text, stops)


def _cost_per_char(stops: tuple[str, ...], text: str) -> float:
    best = float("inf")
    params = SamplingParams(stop=stops)  # compiled here, once (the server's planning thread)
    for _ in range(3):
        detok = Detokenizer(_CharTokenizer(), params, [])
        start = time.perf_counter()
        for char in text:
            detok.update([ord(char)])
            detok.take_delta()
        best = min(best, time.perf_counter() - start)
    return best / len(text)


class _CharTokenizer:
    """One token per character (id = code point): the detokenizer's own work is all that is timed."""

    def decode(self, token_ids: list[int], **kwargs: bool) -> str:
        return "".join(map(chr, token_ids))


def test_cost_per_character_does_not_grow_with_the_number_of_stops() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(2000))
    many = tuple("".join(rng.choice("abcdefgh") for _ in range(8)) + "z" for _ in range(2_000))
    cost_one = _cost_per_char(many[:1], text)
    cost_many = _cost_per_char(many, text)
    assert cost_many < 3 * cost_one + 2e-6, (cost_many, cost_one)  # searching each stop: ~200x


def test_stop_token_ids_are_a_set_lookup() -> None:
    params = SamplingParams(max_tokens=99, stop_token_ids=list(range(10, 800_010)))
    seq = Sequence("r", [1], params)
    seq.output_token_ids.append(5)
    start = time.perf_counter()
    for _ in range(1000):
        assert check_stop(seq, 5, None, frozenset(), 1000) is None
    assert time.perf_counter() - start < 0.05  # a list scan of 800,000 ids: ~10 ms each time
    assert check_stop(seq, 800_009, None, frozenset(), 1000) == Stop(SequenceStatus.FINISHED_STOPPED, 800_009)


def test_check_stop_names_what_ended_the_request_as_vllm() -> None:
    """vLLM's `stop_reason`: the stop string or stop token id; None for EOS and for length."""
    eos = frozenset({2})
    seq = Sequence("r", [1], SamplingParams(max_tokens=3, stop_token_ids=[2, 7]))
    seq.output_token_ids.append(9)
    assert check_stop(seq, 9, "END", eos, 1000) == Stop(SequenceStatus.FINISHED_STOPPED, "END")
    assert check_stop(seq, 7, None, eos, 1000) == Stop(SequenceStatus.FINISHED_STOPPED, 7)
    assert check_stop(seq, 2, None, eos, 1000) == Stop(SequenceStatus.FINISHED_STOPPED, None)  # EOS first
    assert check_stop(seq, 9, None, eos, 2) == Stop(SequenceStatus.FINISHED_LENGTH, None)
    ignoring = Sequence("r", [1], SamplingParams(max_tokens=3, stop_token_ids=[2], ignore_eos=True))
    ignoring.output_token_ids.append(2)
    assert check_stop(ignoring, 2, None, eos, 1000) == Stop(SequenceStatus.FINISHED_STOPPED, 2)
