"""Constrained decoding: a per-request grammar masks its own row of the logits before the draw.

The grammar machinery is llguidance (the Rust grammar engine behind Guidance, on PyPI): JSON schemas
and Lark grammars compile to a matcher that, given the tokens so far, computes the set of allowed next
tokens as a bitmask over the vocabulary (tens of microseconds per token on a 128k vocabulary).

Split of the work:
- ``GrammarCompiler`` (one per tokenizer, built off the engine thread) turns a JSON schema or a Lark
  grammar into a ``CompiledGrammar``: construction of the matcher is the expensive part (lexer and
  grammar checks; up to a second for huge schemas) and runs in the API's worker threads, never on the
  engine thread. Compiled grammars are memoised by their text.
- ``CompiledGrammar.new_constraint()`` gives one request its own ``GrammarConstraint`` (a cheap copy of
  the compiled matcher), carried on that request's ``SamplingParams.constraint``.
- The sampler calls ``apply_constraints`` once per step for the rows that have a constraint (rows without
  one pay nothing) and ``advance_constraints`` once the tokens are drawn.

Consistency: a constraint's state is a function of the request's output tokens. Before each mask it
``sync``s with them: tokens appended since (normally none: the sampler already advanced it) are
consumed, tokens it consumed that the engine did not keep are rolled back. Preemption by recompute
keeps the output tokens, so the state stays as it was; nothing needs to be replayed.

A matcher that ends in an error state (it cannot, short of a bug, since only allowed tokens are drawn)
allows only end-of-sequence tokens from then on, so the request ends instead of producing garbage.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# JSON whitespace: llguidance allows any run of whitespace by default, which lets a weak model pad
# forever (and a small one run into max_tokens). By default JSON is compact: no whitespace outside
# strings, separators "," and ":" (as xgrammar's disable_any_whitespace). `whitespace=True` (a request's
# `allow_json_whitespace`) allows any whitespace between tokens again.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
JSON_WHITESPACE_OPTIONS: dict[str, Any] = {"whitespace_flexible": True}


def json_options(whitespace: bool) -> dict[str, Any]:
    return dict(JSON_WHITESPACE_OPTIONS if whitespace else JSON_OPTIONS)


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists `properties` and
    says nothing of other keys, as xgrammar's strict mode (vLLM's default) and OpenAI's strict schemas:
    a small model otherwise adds keys until `max_tokens`. An explicit `additionalProperties` stays."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


GRAMMAR_CACHE_SIZE = 128
_PARALLEL_MIN_ROWS = 4  # below this, filling masks one by one beats the executor's hand-off


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency in pyproject.toml
        raise RuntimeError(
            "constrained decoding needs the llguidance package (pip install llguidance)"
        ) from exc
    return llguidance


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled (the message says why)."""


class GrammarConstraint:
    """One request's matcher. Written only by the engine thread once the request is queued."""

    __slots__ = ("_matcher", "_tokens", "_eos_token_ids", "_warned", "num_words")

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int], num_words: int) -> None:
        self._matcher = matcher
        self.num_words = num_words  # int32 words of its bitmask: ceil(tokenizer vocabulary / 32)
        self._tokens: list[int] = []  # consumed so far = the request's output tokens
        self._eos_token_ids = tuple(eos_token_ids)
        self._warned = False

    @property
    def matcher(self) -> Any:
        return self._matcher

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def num_consumed(self) -> int:
        return len(self._tokens)

    @property
    def is_error(self) -> bool:
        return bool(self._matcher.is_error())

    @property
    def is_accepting(self) -> bool:
        """The tokens so far form a complete match (the grammar allows ending here)."""
        return bool(self._matcher.is_accepting())

    def fork(self) -> GrammarConstraint:
        """A constraint in this one's initial state for another request (only before this one is used)."""
        if self._tokens:
            raise ValueError("a constraint can be forked only before it consumed any token")
        return GrammarConstraint(self._matcher.deep_copy(), self._eos_token_ids, self.num_words)

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Brings the matcher to exactly ``output_token_ids`` (normally a no-op)."""
        tokens = self._tokens
        n, m = len(tokens), len(output_token_ids)
        if n == m and (n == 0 or tokens[-1] == output_token_ids[-1]):
            return
        common = 0
        limit = min(n, m)
        while common < limit and tokens[common] == output_token_ids[common]:
            common += 1
        if common < n:
            self._matcher.rollback(n - common)
            del tokens[common:]
        for token in output_token_ids[common:]:
            self.accept(int(token))

    def accept(self, token_id: int) -> None:
        """Advances by one drawn token."""
        self._tokens.append(token_id)
        if not self._matcher.consume_token(token_id) and not self._warned:
            self._warned = True
            error = self._matcher.get_error().splitlines()
            logger.warning("grammar matcher refused token %d: %s", token_id, error[0][:300] if error else "")

    def fill_mask(self, bitmask: Tensor, index: int) -> None:
        """Writes the allowed-token bitmask (int32 words, bit i of word w = token 32w + i) into a row."""
        row = bitmask[index, : self.num_words]
        if self._matcher.is_error():
            self._eos_only(row)
            return
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def _eos_only(self, row: Tensor) -> None:
        row.zero_()
        words = row.numpy().view(np.uint32)
        for token in self._eos_token_ids:
            if token // 32 < words.shape[0]:
                words[token // 32] |= np.uint32(1 << (token % 32))


class CompiledGrammar:
    """A compiled grammar; hands each request its own matcher. Safe to share between threads."""

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int], num_words: int, text: str) -> None:
        self._template = matcher  # never advanced
        self._eos_token_ids = tuple(eos_token_ids)
        self._num_words = num_words
        self._lock = threading.Lock()
        self.text = text

    def new_constraint(self) -> GrammarConstraint:
        with self._lock:  # the matcher object is not meant for concurrent use, even for copying
            matcher = self._template.deep_copy()
        return GrammarConstraint(matcher, self._eos_token_ids, self._num_words)


class GrammarCompiler:
    """Compiles schemas and grammars against one tokenizer (the vocabulary of the served model)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        llg = _llguidance()
        import llguidance.hf

        # The tokenizer may know more ids than the model's logits (transformers adds tokens such as Qwen's
        # <|endoftext|> on load) or fewer (padded embeddings); masks cover both, cut to the logits.
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self.num_words = (self.vocab_size + 31) // 32
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self._llg = llg
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
        )
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    # ---- grammar text -----------------------------------------------------------------------------

    def json_schema_grammar(self, schema: dict[str, Any] | None, *, whitespace: bool = False) -> str:
        """Grammar text of a JSON schema; None = any JSON object (OpenAI's ``json_object`` mode).
        Compact JSON unless ``whitespace``."""
        if schema is None:
            schema = {"type": "object"}
        try:
            defaults = json_options(whitespace)
            closed = closed_objects(schema)
            return str(self._llg.LLMatcher.grammar_from_json_schema(closed, defaults=defaults))
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None

    def lark_grammar(self, lark: str) -> str:
        return str(self._llg.LLMatcher.grammar_from_lark(lark))

    # ---- compilation ------------------------------------------------------------------------------

    def compile(self, grammar: str) -> CompiledGrammar:
        """Compiles (or finds in the cache) grammar text from ``*_grammar``; GrammarError when invalid."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)  # drops the GIL while it works
        if matcher.is_error():
            raise GrammarError(_short_error(matcher.get_error()))
        compiled = CompiledGrammar(matcher, self.eos_token_ids, self.num_words, grammar)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def compile_json_schema(
        self, schema: dict[str, Any] | None, *, whitespace: bool = False
    ) -> CompiledGrammar:
        return self.compile(self.json_schema_grammar(schema, whitespace=whitespace))

    def compile_lark(self, lark: str) -> CompiledGrammar:
        return self.compile(self.lark_grammar(lark))

    def compile_regex(self, regex: str) -> CompiledGrammar:
        """The whole output matches ``regex`` (llguidance's regex syntax: Rust's ``regex`` crate)."""
        try:
            grammar = str(self._llg.LLMatcher.grammar_from_regex(regex))
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(_short_error(str(exc))) from None
        return self.compile(grammar)


def lark_json(schema: dict[str, Any], *, whitespace: bool = False) -> str:
    """``%json {...}`` for a Lark grammar: the schema with this module's JSON whitespace options."""
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": json_options(whitespace)})


def _short_error(message: str) -> str:
    message = message.strip() or "grammar error"
    return message if len(message) <= 500 else message[:497] + "..."


# ---- the sampler's two calls -----------------------------------------------------------------------

_executor: Any = None
_executor_lock = threading.Lock()


def _parallel_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = _llguidance().LLExecutor(
                num_threads=max(1, min(8, (torch.get_num_threads() + 1) // 2))
            )
        return _executor


def allowed_tokens(constraints: Sequence[GrammarConstraint], vocab: int) -> Tensor:
    """[len(constraints), vocab] bool on the CPU: the tokens each constraint allows next."""
    words = max(c.num_words for c in constraints)
    bitmask = torch.zeros(len(constraints), words, dtype=torch.int32, device="cpu")
    matchers = [(c.matcher, i) for i, c in enumerate(constraints) if not c.matcher.is_error()]
    same_size = all(c.num_words == words for c in constraints)
    if len(matchers) >= _PARALLEL_MIN_ROWS and len(matchers) == len(constraints) and same_size:
        _parallel_executor().unsafe_compute_mask_ptr(
            matchers, bitmask.data_ptr(), words * 4, len(constraints)
        )
    else:
        for i, c in enumerate(constraints):
            c.fill_mask(bitmask, i)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if bits.shape[1] < vocab:  # logits wider than the tokenizer: ids it never makes stay forbidden
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return torch.from_numpy(bits.astype(np.bool_, copy=False))


def apply_constraints(
    logits: Tensor,
    idx: Sequence[int],
    constraints: Sequence[GrammarConstraint],
    output_ids: Sequence[Sequence[int]],
    *,
    copy: bool,
) -> Tensor:
    """Sets the logits of tokens a row's grammar forbids to -inf, for the rows ``idx`` only.

    ``constraints[j]`` and ``output_ids[j]`` (the request's tokens so far) belong to row ``idx[j]``.
    ``copy``: write into a copy (the caller still needs ``logits`` unmasked), else in place.
    """
    for constraint, tokens in zip(constraints, output_ids, strict=True):
        constraint.sync(tokens)
    allowed = allowed_tokens(constraints, logits.shape[1])
    empty = ~allowed.any(dim=1)
    if bool(empty.any()):  # cannot happen with a consistent matcher; end the row rather than sample noise
        for j in empty.nonzero().flatten().tolist():
            eos = [t for t in constraints[j].eos_token_ids if t < allowed.shape[1]]
            allowed[j, eos] = True
    out = logits.clone() if copy else logits
    index = torch.tensor(list(idx), device=logits.device)
    out[index] = out[index].masked_fill(~allowed.to(logits.device, non_blocking=True), -torch.inf)
    return out


def advance_constraints(constraints: Sequence[GrammarConstraint], token_ids: Sequence[int]) -> None:
    """Each matcher consumes the token just drawn for its row (``token_ids[j]`` for ``constraints[j]``)."""
    for constraint, token_id in zip(constraints, token_ids, strict=True):
        constraint.accept(int(token_id))
