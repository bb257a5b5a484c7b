"""Per-request sampling parameters, validated once.

Field names, defaults and ranges follow the OpenAI completions API and vLLM's ``SamplingParams``
(temperature 0 = greedy; ``top_k`` 0 or -1 = off; logprobs = number of top alternatives).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from base_engine.stop_strings import StopAutomaton, compile_stops

# Temperatures below this are treated as greedy: dividing logits by a tiny number overflows, and
# vLLM uses the same cut-off.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _check_int(name: str, value: object, lo: int, hi: int | None, allowed: str) -> None:
    # bool is an int subclass; `max_tokens=True` is a caller bug, not the value 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def _check_float(name: str, value: object, ok: Callable[[float], bool], allowed: str) -> None:
    # Written as "not ok(...)" so that NaN, which fails every comparison, is refused too.
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``stop`` is normalized to a tuple of non-empty strings and ``stop_token_ids`` to a list of ints
    (looked up as the set ``stop_token_set``: one hash per token, however many there are); the stop
    strings are compiled once into ``stop_automaton`` (base_engine/stop_strings.py).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: top-N per prompt token (base_engine/prompt_logprobs.py)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's detokenizer option (base_engine/detokenizer.py)
    include_stop_str_in_output: bool = False
    # Batch-invariant execution: this request's tokens and logprobs are bitwise the same
    # whatever else shares its steps. A step that holds such a request runs the fixed-order kernels.
    deterministic: bool = False
    # Speculative decoding may score drafts for this request (base_engine/speculative/); False opts out.
    # Either way its tokens are the same: speculation only changes how many are computed per step.
    speculative: bool = True
    # Constrained decoding (base_engine/constraints.py): this request's own grammar matcher, which masks
    # its row of the logits before each draw. One request per object (it holds the request's state).
    constraint: Any = None
    # Logit rules (base_engine/logit_rules.py): vLLM's min_tokens, allowed_token_ids and bad words (as
    # token sequences: the server encodes the words), OpenAI's logit_bias (token id -> added value).
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    logit_bias: dict[int, float] | None = None
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    stop_automaton: StopAutomaton | None = field(init=False, repr=False, compare=False)  # of ``stop``

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, None, ">= 1")
        _check_float("temperature", self.temperature, lambda v: v >= 0, ">= 0 (0 = greedy)")
        _check_float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        if self.top_k != -1:
            _check_int("top_k", self.top_k, 0, None, ">= 1, or 0 / -1 for off")
        _check_float("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
        if self.seed is not None:
            _check_int("seed", self.seed, _SEED_MIN, _SEED_MAX, f"in [{_SEED_MIN}, {_SEED_MAX}] or None")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None:
            allowed = f"in [0, {MAX_LOGPROBS}] or None"
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, allowed)
        if self.constraint is not None and not all(
            callable(getattr(self.constraint, m, None)) for m in ("sync", "accept", "fill_mask")
        ):
            raise ValueError(f"constraint must be a GrammarConstraint, got {type(self.constraint).__name__}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        _check_logit_rules(self)
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        self.stop_token_set = frozenset(self.stop_token_ids)
        self.stop_automaton = compile_stops(self.stop) if self.stop else None  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: no randomness is drawn for this request."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        """True when any of the repetition / frequency / presence penalties changes the logits."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def has_logit_rules(self) -> bool:
        """True when min_tokens, allowed_token_ids, bad words or logit_bias may change the logits."""
        return bool(self.min_tokens or self.allowed_token_ids or self.bad_words_token_ids or self.logit_bias)

    @property
    def max_stop_len(self) -> int:
        """Length in characters of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)  # type: ignore[union-attr]


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_logit_rules(params: SamplingParams) -> None:
    max_tokens = params.max_tokens
    _check_int("min_tokens", params.min_tokens, 0, max_tokens, f"in [0, max_tokens={max_tokens}]")
    allowed = params.allowed_token_ids
    if allowed is not None and (
        isinstance(allowed, str) or not allowed or not all(_is_token_id(t) for t in allowed)
    ):
        raise ValueError(
            f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), got {allowed!r}"
        )
    words = params.bad_words_token_ids
    if words is not None and not all(
        isinstance(w, Sequence) and w and all(_is_token_id(t) for t in w) for w in words
    ):
        raise ValueError(f"bad_words_token_ids must be a list of non-empty token id lists, got {words!r}")
    bias = params.logit_bias
    if bias is not None and not (
        isinstance(bias, dict)
        and all(_is_token_id(t) for t in bias)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in bias.values())
        and all(math.isfinite(v) for v in bias.values())
    ):
        raise ValueError(f"logit_bias must map token ids (integers >= 0) to finite numbers, got {bias!r}")


def _normalize_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return tuple(items)


def _normalize_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    bad = not isinstance(ids, Sequence) or isinstance(ids, str)
    if bad or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):  # type: ignore[union-attr]
        raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
    return list(ids)  # type: ignore[arg-type]
