"""Tenant regexes (target_modules, exclude_modules, layers_pattern, rank_pattern, alpha_pattern) are
matched in linear time with PEFT's meaning; what RE2 cannot express is refused naming the field.

Python's `re` once took 71 s of validation on `(.|.){0,24}Z` (each step doubles it)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import AdapterFormatError
from adapters.peft_rank import parse_spec
from adapters.peft_targets import module_keys, resolve_targets
from adapters.safe_regex import MAX_PATTERN_CHARS, MAX_PATTERN_KEYS, compile_pattern
from tests.harness.peft_adapters import tiny_shapes

EVIL = "(.|.){0,24}Z"  # exponential for a backtracking engine on every module name
KEYS = module_keys(tiny_shapes())
BASE: dict[str, Any] = {"peft_type": "LORA", "r": 8, "lora_alpha": 8}
# Linear-time matching takes milliseconds; a backtracking engine takes minutes. The bound leaves room for a
# loaded CI machine (these runs took < 0.05 s here) without letting exponential time through.
BOUND_S = 2.0


def _timed(fn: Any) -> tuple[float, BaseException | None]:
    start = time.perf_counter()
    try:
        fn()
    except AdapterFormatError as exc:
        return time.perf_counter() - start, exc
    return time.perf_counter() - start, None


@pytest.mark.parametrize(
    "config",
    [
        {"target_modules": EVIL},
        {"target_modules": ["q_proj"], "exclude_modules": EVIL},
        {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": EVIL},
        {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": ["h", EVIL]},
        {"target_modules": ["q_proj"], "rank_pattern": {EVIL: 4}},
        {"target_modules": ["q_proj"], "alpha_pattern": {EVIL: 4}},
        {"target_modules": "(.*)*(.*)*(.*)*(.*)*(.*)*(.*)*(.*)*Z"},
        {"target_modules": ["q_proj"], "rank_pattern": {"(a|aa)*" * 8 + "Z": 4}},
    ],
    ids=["target", "exclude", "layers", "layers_list", "rank", "alpha", "nested_stars", "alternation"],
)
def test_hostile_patterns_take_milliseconds(config: dict[str, Any]) -> None:
    cfg = BASE | config

    def run() -> None:
        spec = parse_spec(cfg)
        for key in resolve_targets(cfg, tiny_shapes()):
            spec.rank_and_scale(key)

    elapsed, _ = _timed(run)
    assert elapsed < BOUND_S, f"{config} took {elapsed:.2f} s"


def test_evil_target_is_refused_quickly_with_the_field_named() -> None:
    elapsed, exc = _timed(lambda: resolve_targets(BASE | {"target_modules": EVIL}, tiny_shapes()))
    assert elapsed < BOUND_S
    assert exc is not None and "targets no projection" in str(exc)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "backreference": ({"target_modules": r"(.*)\.\1"}, "target_modules: regular expression .* linear time"),
    "lookahead": ({"exclude_modules": r"(?=.*q).*"}, "exclude_modules: regular expression .*RE2"),
    "lookbehind_rank": ({"rank_pattern": {r"(?<=self_attn\.)q_proj": 4}}, "rank_pattern: regular expr"),
    "atomic_alpha": ({"alpha_pattern": {r"(?>q)_proj": 4}}, "alpha_pattern: regular expression"),
    "possessive": ({"target_modules": r".*q_proj++"}, "target_modules: regular expression"),
    "big_repeat": ({"target_modules": r".{0,2000}"}, "repetition"),
    "python_min_omitted": ({"target_modules": r"model.{,40}q_proj"}, r"'\{,n\}'"),
    "posix_class": ({"target_modules": r"[[:alpha:].]*q_proj"}, "POSIX"),
    "non_ascii": ({"target_modules": ".*q_pr\u00f6j"}, "non-ASCII"),
    "too_long": ({"target_modules": "a" * (MAX_PATTERN_CHARS + 1)}, "more than the limit"),
    "too_many_keys": (
        {"rank_pattern": {f"k{i}": 4 for i in range(MAX_PATTERN_KEYS + 1)}},
        "rank_pattern has .* entries",
    ),
    "too_many_names": ({"target_modules": ["q_proj"] * (MAX_PATTERN_KEYS + 1)}, "target_modules has"),
    "python_syntax_error": ({"layers_to_transform": [0], "layers_pattern": "lay(ers"}, "layers_pattern: inv"),
    "re2_only_syntax": ({"target_modules": r"(?<name>.*)q_proj"}, "target_modules: invalid regular"),
    "compile_memory": ({"target_modules": "(((a{100}){100}){100})"}, "target_modules: regular expression"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_patterns_name_the_field(case: str) -> None:
    changes, cause = REFUSED[case]
    cfg = BASE | {"target_modules": ["q_proj"]} | changes

    def run() -> None:
        parse_spec(cfg)
        resolve_targets(cfg, tiny_shapes())

    elapsed, exc = _timed(run)
    assert exc is not None, f"{case} was accepted"
    assert re.search(cause, str(exc)), str(exc)
    assert elapsed < BOUND_S


def test_total_pattern_budget() -> None:
    keys = {f"{'x' * 1000}{i}": 4 for i in range(70)}
    with pytest.raises(AdapterFormatError, match="characters together"):
        parse_spec(BASE | {"rank_pattern": keys})


# ---- same answers as Python's re (PEFT's engine) on the module names ----------------------------

_ATOMS = [
    r"\.",
    ".",
    "q_proj",
    "k_proj",
    "self_attn",
    "mlp",
    "layers",
    "model",
    r"\d",
    r"\d+",
    r"\w",
    "[0-9]",
    "[^.]",
    "[a-z_]",
    "0",
    "1",
    "_",
    "^",
    "$",
    r"\b",
    r"\A",
]


def _regex() -> st.SearchStrategy[str]:
    atom = st.sampled_from(_ATOMS)

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        quantified = st.tuples(inner, st.sampled_from(["*", "+", "?", "*?", "+?", "{1,2}", "{0,3}", ""]))
        return st.one_of(
            st.lists(inner, min_size=1, max_size=4).map("".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
            quantified.map(lambda t: f"(?:{t[0]}){t[1]}"),
            inner.map(lambda x: f"(?i:{x})"),
        )

    return st.recursive(atom, extend, max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(pattern=_regex())
def test_fullmatch_and_match_agree_with_python_re(pattern: str) -> None:
    try:
        ours = compile_pattern("target_modules", pattern)
    except AdapterFormatError:
        return  # refusing is always allowed; answering differently is not
    python = re.compile(pattern)
    suffix = compile_pattern("rank_pattern", pattern, r"(.*\.)?({})$")
    python_suffix = re.compile(rf"(.*\.)?({pattern})$")
    layers = compile_pattern("layers_pattern", pattern, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.")
    python_layers = re.compile(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.")
    for key in KEYS:
        assert bool(ours.fullmatch(key)) == bool(python.fullmatch(key)), (pattern, key)
        assert bool(suffix.match(key)) == bool(python_suffix.match(key)), (pattern, key)
        theirs = python_layers.match(key)
        mine = layers.match(key)
        mine_idx = int(mine.group(b"idx")) if mine else None
        assert mine_idx == (int(theirs.group("idx")) if theirs else None), (pattern, key)


def test_peft_style_patterns_resolve_as_before() -> None:
    cfg = BASE | {
        "target_modules": r".*\.(q_proj|v_proj|down_proj)",
        "exclude_modules": r"model\.layers\.1\.mlp\..*",
        "rank_pattern": {r"layers\.0\.self_attn\.q_proj": 4, "v_proj": 2},
        "alpha_pattern": {r"^model.layers.0.self_attn.v_proj": 3},
    }
    targets = resolve_targets(cfg, tiny_shapes())
    assert sorted(targets) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    spec = parse_spec(cfg)
    assert spec.rank_and_scale("model.layers.0.self_attn.q_proj") == (4, 2.0)
    assert spec.rank_and_scale("model.layers.1.self_attn.q_proj") == (8, 1.0)
    assert spec.rank_and_scale("model.layers.0.self_attn.v_proj") == (2, 1.5)
    assert spec.rank_and_scale("model.layers.1.self_attn.v_proj") == (2, 4.0)


_KEY_PARTS = ["q_proj", "v_proj", "down_proj", "mlp", "self_attn", "layers", "model", "0", "1", "q.proj", "."]


def _peft_pattern_key(patterns: list[str], module_key: str) -> str:
    """peft.utils.other.get_pattern_key, verbatim (Python's re)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return key
    return module_key


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(
        st.one_of(
            st.lists(st.sampled_from(_KEY_PARTS), min_size=1, max_size=4).map(".".join),  # literal
            st.lists(st.sampled_from(_KEY_PARTS), min_size=1, max_size=3).map("".join),  # run together
            _regex(),
        ),
        min_size=1,
        max_size=8,
        unique=True,
    )
)
def test_rank_pattern_first_match_agrees_with_peft(keys: list[str]) -> None:
    try:
        spec = parse_spec(BASE | {"rank_pattern": {k: i + 1 for i, k in enumerate(keys)}})
    except AdapterFormatError:
        return
    for module_key in KEYS:
        expected = _peft_pattern_key(keys, module_key)
        r, _ = spec.rank_and_scale(module_key)
        assert r == (keys.index(expected) + 1 if expected in keys else 8), (keys, module_key)


def test_many_costly_patterns_stop_at_the_cpu_budget() -> None:
    from adapters.types import BaseModelShapes

    big = BaseModelShapes("llama", 126, 16384, 53248, 128, 8, 128, 128256)
    keys = {f"(.|.){{0,20}}[a-z]{{3}}(x|y){{0,8}}Z{i:04d}": 4 for i in range(1000)}
    cfg = BASE | {"target_modules": "all-linear", "rank_pattern": keys}
    start = time.thread_time()
    with pytest.raises(AdapterFormatError, match="took more than"):
        spec = parse_spec(cfg)
        for key in resolve_targets(cfg, big):
            spec.rank_and_scale(key)
    assert time.thread_time() - start < 6  # the 3 s budget, not the ~60 s all matches would take
