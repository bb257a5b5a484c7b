"""Stop strings matched in time independent of their number: one Aho-Corasick automaton per request
(Aho & Corasick, "Efficient string matching", CACM 1975).

Searching each stop string in each token's new text costs `num_stops x window` per token, on the engine
thread that every co-batched request waits for: 10,000 stop strings in one request took another
request's decode from 6.5 to 205 ms per token. The automaton is built once per request, in time linear
in the stops' total length (the server bounds them: api/inference/limits.py), and then reads each new
character once (amortized), however many stops there are.

Its state is the longest end of the text read so far that begins some stop string, which is also how
much of the text a stream must hold back (it may still grow into a stop):

    stops ("abc", "bcd"):  read "xab" -> state "ab" (hold 2);  then "c" -> match "abc" ending here
"""

from __future__ import annotations

import functools
from collections import deque
from typing import NamedTuple


class StopMatch(NamedTuple):
    end: int  # offset in the text just fed where the stop string ends (exclusive)
    stop: str  # the stop string: the longest one that ends there


class StopAutomaton:
    """The automaton of `stops` (non-empty strings), immutable and shared by the choices of a request
    (`compile_stops`); a reader keeps its own state, 0 before any text. The first stop string to end
    wins, and of those ending at the same character the longest (the one that began first)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self._stops = stops
        self._goto: list[dict[str, int]] = [{}]  # state -> next char -> state; state 0 = nothing read
        self._depth = [0]  # length of the stop prefix a state stands for
        self._match = [-1]  # index into stops of the longest one ending in this state, -1 for none
        for index, stop in enumerate(stops):
            self._insert(stop, index)
        self._fail = self._link()

    def num_held(self, state: int) -> int:
        """Length of the longest end of the text read (up to `state`) that begins a stop string."""
        return self._depth[state]

    def feed(self, state: int, text: str) -> tuple[int, StopMatch | None]:
        """Reads `text` after what led to `state`: the new state and the first stop string that ends
        in `text`, or None."""
        goto, fail, match = self._goto, self._fail, self._match
        for i, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if match[state] >= 0:
                return state, StopMatch(i + 1, self._stops[match[state]])
        return state, None

    def _insert(self, stop: str, index: int) -> None:
        goto, state = self._goto, 0
        for char in stop:
            nxt = goto[state].get(char)
            if nxt is None:
                nxt = len(goto)
                goto[state][char] = nxt
                goto.append({})
                self._depth.append(self._depth[state] + 1)
                self._match.append(-1)
            state = nxt
        if self._match[state] < 0:  # a repeated stop string keeps its first index
            self._match[state] = index

    def _link(self) -> list[int]:
        """Failure links, breadth first: a state's link is the longest proper end of its prefix that is
        a state too; a state that ends no stop string of its own inherits its link's match (shorter)."""
        goto, match = self._goto, self._match
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            for char, nxt in goto[state].items():
                link = fail[state]
                while link and char not in goto[link]:
                    link = fail[link]
                fail[nxt] = goto[link].get(char, 0)
                if match[nxt] < 0:
                    match[nxt] = match[fail[nxt]]
                queue.append(nxt)
        return fail


@functools.lru_cache(maxsize=64)
def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of `stops`, built once for every choice of a request that repeats them; built
    where the request's `SamplingParams` are (the server's planning thread), not on the engine thread."""
    return StopAutomaton(stops)
