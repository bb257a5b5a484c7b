"""Per-module rank and scale of a PEFT LoRA config: `r`, `lora_alpha`, `use_rslora`, `rank_pattern` and
`alpha_pattern`, with keys matched as `peft.utils.other.get_pattern_key` does
(`re.match(rf"(.*\\.)?({key})$", module_key)`, first key wins) but by RE2 in linear time; the scale is
`alpha / r`, or `alpha / sqrt(r)` with rsLoRA (Kalajdzievski 2023, arXiv:2312.03732)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

from adapters.peft_fields import check_pattern_budget, check_type, is_default
from adapters.safe_regex import LinearPattern, PatternCache
from adapters.types import AdapterFormatError


@dataclass(frozen=True)
class LoraSpec:
    """The parts of the config that set each module's rank and scale."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    has_velora: bool  # VeLoRA saves a training-only `lora_velora_embed` buffer per module
    patterns: PatternCache = field(default_factory=PatternCache, compare=False, repr=False)
    _indexes: dict[str, _PatternIndex] = field(default_factory=dict, compare=False, repr=False)

    def rank_and_scale(self, module_key: str) -> tuple[int, float]:
        """(r, scale) for one module key such as "model.layers.0.self_attn.q_proj"."""
        r = self.rank_pattern.get(self._index("rank").first(module_key), self.r)
        alpha = self.alpha_pattern.get(self._index("alpha").first(module_key), self.lora_alpha)
        scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return r, float(scale)

    def _index(self, which: str) -> _PatternIndex:
        if which not in self._indexes:
            patterns = self.rank_pattern if which == "rank" else self.alpha_pattern
            self._indexes[which] = _PatternIndex(patterns, self.patterns)
        return self._indexes[which]


# `lora_alpha`, `alpha_pattern` values and ranks are used as floats (the scale is alpha / r): a JSON
# integer beyond the float range (e.g. 2**1100) is refused here, a large finite one by the delta bound.
MAX_ALPHA = sys.float_info.max
MAX_RANK = 1 << 31  # a factor's dimension; the engine's max_lora_rank is far below


def _alpha(name: str, value: int | float) -> float:
    if isinstance(value, int) and not -MAX_ALPHA <= value <= MAX_ALPHA:
        raise AdapterFormatError(
            f"adapter_config.json: {name} is an integer of {value.bit_length()} bits, beyond the limit "
            f"of {MAX_ALPHA:.4g} (the largest float64)"
        )
    return float(value)


def _rank(name: str, value: int) -> int:
    if value > MAX_RANK:
        raise AdapterFormatError(
            f"adapter_config.json: {name} is an integer of {value.bit_length()} bits, above the limit of "
            f"{MAX_RANK}"
        )
    return value


_LITERAL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


class _PatternIndex:
    """PEFT's get_pattern_key over one rank_pattern / alpha_pattern: the first key (in order) for which
    `re.match(rf"(.*\\.)?({key})$", module_key)` matches.

    A key of letters, digits, `_` and `.` (almost every real one) matches exactly when the module key's
    suffix of the same length starts the key or follows a `.`, and equals the key at every position
    but the key's dots (each `.` is a regex wildcard). Such keys are grouped by (length, dot positions)
    and answered with one dictionary lookup per group; only the other keys are matched with RE2, and
    only those ahead of the best literal hit.
    """

    def __init__(self, patterns: dict[str, Any], cache: PatternCache) -> None:
        self.order = list(patterns)
        self.cache = cache
        self.literal_groups: dict[tuple[int, tuple[int, ...]], dict[str, int]] = {}
        self.regex_keys: list[tuple[int, str]] = []
        for i, key in enumerate(self.order):
            if key and _LITERAL_CHARS.issuperset(key):
                dots = tuple(j for j, c in enumerate(key) if c == ".")
                self.literal_groups.setdefault((len(key), dots), {}).setdefault(key, i)
            else:
                self.regex_keys.append((i, key))

    def first(self, module_key: str) -> str:
        best = len(self.order)
        with self.cache.timed():
            for (length, dots), keys in self.literal_groups.items():
                start = len(module_key) - length
                if start < 0 or (start > 0 and module_key[start - 1] != "."):
                    continue
                suffix = module_key[start:]
                if dots:
                    chars = list(suffix)
                    for j in dots:
                        chars[j] = "."
                    suffix = "".join(chars)
                best = min(best, keys.get(suffix, best))
            for i, key in self.regex_keys:
                if i >= best:
                    break
                if _suffix_pattern(self.cache, key).match(module_key):
                    best = i
                    break
        return self.order[best] if best < len(self.order) else module_key


def _suffix_pattern(
    cache: PatternCache, key: str, field_name: str = "rank_pattern/alpha_pattern"
) -> LinearPattern:
    return cache.get(field_name, key, r"(.*\.)?({})$")


def parse_spec(cfg: dict[str, Any]) -> LoraSpec:
    """Rank, alpha and their per-module patterns, type-checked."""
    check_pattern_budget(cfg)
    r = check_type(cfg, "r", int, 8)
    alpha = check_type(cfg, "lora_alpha", (int, float), 8)
    rank_pattern = check_type(cfg, "rank_pattern", dict, {}) or {}
    alpha_pattern = check_type(cfg, "alpha_pattern", dict, {}) or {}
    for key, value in rank_pattern.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise AdapterFormatError(f"rank_pattern[{key!r}]={value!r}, expected a positive int")
        _rank(f"rank_pattern[{key!r}]", value)
    for key, value in alpha_pattern.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise AdapterFormatError(f"alpha_pattern[{key!r}]={value!r}, expected a number")
    if r <= 0:
        raise AdapterFormatError(f"r={r}, expected a positive int")
    _rank("r", r)
    alphas = {key: _alpha(f"alpha_pattern[{key!r}]", value) for key, value in alpha_pattern.items()}
    cache = PatternCache()
    with cache.timed():
        for name, patterns in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
            for key in patterns:
                _suffix_pattern(cache, key, name)  # refuses what RE2 cannot match as PEFT would
    use_rslora = check_type(cfg, "use_rslora", bool, False)
    has_velora = not is_default(cfg.get("velora_config"))
    lora_alpha = _alpha("lora_alpha", alpha)
    return LoraSpec(r, lora_alpha, use_rslora, dict(rank_pattern), alphas, has_velora, cache)
