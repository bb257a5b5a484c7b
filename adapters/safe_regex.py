"""Tenant-supplied regular expressions, matched in time linear in the text (RE2), with PEFT's meaning.

PEFT matches `target_modules` / `exclude_modules` (a string), `layers_pattern` and the keys of
`rank_pattern` / `alpha_pattern` with Python's backtracking `re`: a hostile pattern such as
`(.|.){0,24}Z` needs ~2^24 steps per module name, all of them holding the GIL. Here a pattern is
accepted only when

1. it is ASCII, at most `MAX_PATTERN_CHARS` long (and a config's patterns together at most
   `MAX_TOTAL_PATTERN_CHARS`, checked by adapters/peft_fields.py), with groups nested at most
   `MAX_GROUP_DEPTH` deep (Python's `re` compiles groups recursively: 500 nested parentheses exhaust
   the interpreter's stack);
2. Python's `re` compiles it, exactly as PEFT would see it (so we never accept what PEFT refuses);
3. it avoids the few constructs that both engines accept but read differently: Python 3.11's
   `x{,n}` (RE2: the literal text), a POSIX class `[[:alpha:]]` (Python: a set of `[`, `:`, ...)
   and `\\B` (differs on the empty string, which is a module key);
4. RE2 (google-re2) compiles it within `MAX_RE2_MEMORY` (so no backreferences, lookaround, atomic
   groups or possessive quantifiers; repetition counts up to 1000).

Each match is then linear in the module name, but a config may hold many patterns: `PatternCache`
(one per parsed config, so no compiled pattern outlives its parse) stops a config whose patterns
spend more than `MAX_MATCH_CPU_S` matching, with an `AdapterFormatError`.

Matching then runs on RE2 only. On the texts matched here (module keys: ASCII letters, digits, `_`
and `.`, no newline) both engines agree on every accepted pattern: `\\d`, `\\w`, `\\s` and case folding
differ only outside ASCII, `$` only before a trailing newline, and RE2's leftmost-first submatches
are Perl's (and Python's) for patterns without backreferences. A refused pattern is an
`AdapterFormatError` naming the field and why.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import re2

from adapters.types import AdapterFormatError

MAX_PATTERN_CHARS = 1024  # one pattern (PEFT's real ones are tens of characters)
MAX_TOTAL_PATTERN_CHARS = 64 << 10  # all patterns of one adapter_config.json together
MAX_PATTERN_KEYS = 1024  # entries of rank_pattern / alpha_pattern (one per module is 7 * layers)
MAX_GROUP_DEPTH = 32  # nested groups in one tenant pattern (PEFT's real ones: 1-3)
MAX_RE2_MEMORY = 256 << 10  # RE2's budget for one compiled program and its DFA cache
# CPU seconds one config's patterns may spend matching module names (per PatternCache). Linear time
# still multiplies: 2 x 1024 pattern keys x 7 x 126 projections is ~2M matches, ~100 s when each
# pattern defeats RE2's DFA; a real per-module rank_pattern of a 80-layer model takes well under 1 s.
MAX_MATCH_CPU_S = 3.0

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.max_mem = MAX_RE2_MEMORY
_RE2_OPTIONS.log_errors = False

__all__ = [
    "MAX_GROUP_DEPTH",
    "MAX_PATTERN_CHARS",
    "MAX_PATTERN_KEYS",
    "MAX_TOTAL_PATTERN_CHARS",
    "LinearPattern",
    "PatternCache",
    "compile_pattern",
]


class LinearPattern:
    """`re`'s match/fullmatch of one compiled pattern, run by RE2 on the text's UTF-8 bytes (the
    binding's str path maps every offset back to characters, several times slower); groups of a
    match are bytes (`int(m.group("idx"))` works as with str)."""

    __slots__ = ("_regexp",)

    def __init__(self, regexp: Any) -> None:
        self._regexp = regexp

    def match(self, text: str) -> Any:
        return self._regexp.match(text.encode())

    def fullmatch(self, text: str) -> Any:
        return self._regexp.fullmatch(text.encode())


def _divergent_construct(pattern: str) -> str | None:
    """The first construct both engines accept but read differently, or None."""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        nxt = pattern[i + 1] if i + 1 < len(pattern) else ""
        if c == "\\":
            if nxt == "B":
                return "'\\B' (RE2 and Python disagree on the empty module name)"
            i += 2
            continue
        if c == "{" and nxt == ",":
            return "'{,n}' (write '{0,n}')"
        if c == "[" and nxt == ":":
            return "'[:' (a POSIX class for RE2, a set of characters for Python)"
        i += 1
    return None


def _group_depth(pattern: str) -> int:
    """How deep the parentheses of `pattern` nest (escapes and character classes skipped)."""
    depth = deepest = 0
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":
                i += 1
            if pattern[i + 1 : i + 2] == "]":  # a leading ']' is a literal in the class
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


class _Refused(Exception):
    pass


def _compile(pattern: str, template: str) -> LinearPattern:
    """The compiled expression, or _Refused(reason)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _Refused(f"is {len(pattern)} characters long, more than the limit of {MAX_PATTERN_CHARS}")
    if not pattern.isascii():
        raise _Refused("has non-ASCII characters; module names are ASCII")
    full = template.replace("{}", pattern)
    divergent = _divergent_construct(pattern)
    if divergent is not None:
        raise _Refused(f"uses {divergent}, which is not supported")
    depth = _group_depth(pattern)
    if depth > MAX_GROUP_DEPTH:
        raise _Refused(f"nests groups {depth} deep, more than the limit of {MAX_GROUP_DEPTH}")
    try:
        re.compile(full)  # PEFT's syntax: what Python refuses, PEFT would fail on
    except re.error as exc:
        raise _Refused(f"is invalid ({exc})") from None
    except RecursionError:  # a nesting the count above missed: still a refusal, never a crash
        raise _Refused(f"nests too deep for Python's re (limit {MAX_GROUP_DEPTH} groups)") from None
    try:
        return LinearPattern(re2.compile(full.encode(), _RE2_OPTIONS))
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise _Refused(
            "is not supported: patterns are matched in linear time (RE2 syntax: no backreferences, "
            "lookaround, atomic groups, possessive quantifiers or repetition counts above 1000; at most "
            f"{MAX_RE2_MEMORY >> 20} MiB compiled) ({reason})"
        ) from None


def compile_pattern(field_name: str, pattern: str, template: str = "{}") -> LinearPattern:
    """`template` with `{}` replaced by the tenant's `pattern`, compiled for linear-time matching.

    The checks on length, characters and divergent constructs apply to `pattern`; Python's and RE2's
    syntax to the whole expression, as PEFT builds it. Refused: AdapterFormatError naming `field_name`.
    """
    try:
        return _compile(pattern, template)
    except _Refused as exc:
        if "invalid (" in str(exc):
            raise AdapterFormatError(
                f"{field_name}: invalid regular expression {pattern!r} {str(exc).removeprefix('is invalid ')}"
            ) from None
        raise AdapterFormatError(f"{field_name}: regular expression {pattern!r} {exc}") from None


class PatternCache:
    """The compiled patterns of one adapter config, each compiled once and dropped with the config.

    No process-wide cache: each RE2 object may grow a DFA cache up to `MAX_RE2_MEMORY` as it matches,
    so compiled patterns live only as long as the parse that needs them.
    """

    def __init__(self, max_cpu_s: float = MAX_MATCH_CPU_S) -> None:
        self._compiled: dict[tuple[str, str], LinearPattern] = {}
        self._max_cpu_s = max_cpu_s
        self._cpu_spent = 0.0
        self._cpu_since: float | None = None  # thread CPU clock when the open `timed` block began

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Count the CPU this thread spends inside the block (compiling and matching) against the
        budget; `get` refuses to go on past it. CPU time, not wall time: a loaded machine does not
        refuse what an idle one takes."""
        if self._cpu_since is not None:  # nested: the outer block counts
            yield
            return
        self._cpu_since = time.thread_time()
        try:
            yield
        finally:
            self._cpu_spent += time.thread_time() - self._cpu_since
            self._cpu_since = None

    def get(self, field_name: str, pattern: str, template: str = "{}") -> LinearPattern:
        """The compiled pattern (compiled on first use)."""
        spent = self._cpu_spent
        if self._cpu_since is not None:
            spent += time.thread_time() - self._cpu_since
        if spent > self._max_cpu_s:
            raise AdapterFormatError(
                f"adapter_config.json: matching its regular expressions ({field_name} and others) "
                f"against the model's modules took more than {self._max_cpu_s:g} s of CPU; use fewer "
                "or simpler patterns"
            )
        found = self._compiled.get((pattern, template))
        if found is None:
            found = self._compiled[(pattern, template)] = compile_pattern(field_name, pattern, template)
        return found
