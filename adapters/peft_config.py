"""Read a PEFT LoRA `adapter_config.json` exactly as PEFT (0.21, `peft/tuners/lora/config.py`) reads it.

Which modules an adapter targets follows `peft.tuners.tuners_utils.check_target_module_exists` (regex
full-match for a string, exact-or-`.suffix` match for a list, `exclude_modules` first, then
`layers_to_transform` / `layers_pattern`); per-module rank and alpha follow
`peft.utils.other.get_pattern_key` (`re.match(rf"(.*\\.)?({key})$", module_key)`, first key wins); the
scale is `alpha / r`, or `alpha / sqrt(r)` with rsLoRA (Kalajdzievski 2023, arXiv:2312.03732).

Every tenant-supplied pattern is compiled by adapters/safe_regex.py and matched by RE2 in linear time
(PEFT's `re` backtracks: `(.|.){0,24}Z` took minutes); patterns RE2 cannot express, and configs whose
patterns are too many or too long, are refused naming the field.

Every field is applied, ignored because it cannot change inference math, or refused when it is not at its
default (see adapters/README.md for the full list). Fail closed: anything this module cannot prove PEFT
would apply the same way is an `AdapterFormatError` naming the field.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from adapters.safe_regex import (
    MAX_PATTERN_KEYS,
    MAX_TOTAL_PATTERN_CHARS,
    LinearPattern,
    PatternCache,
)
from adapters.types import LORA_MODULES, AdapterFormatError, BaseModelShapes

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING entry for all three architectures, used when
# the saved config has `target_modules: null`.
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("q_proj", "v_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# Fields whose non-default value changes what the adapter computes in a way the engine cannot reproduce.
REFUSED_WHEN_SET: dict[str, str] = {
    "use_dora": "DoRA rescales each output column by a learned magnitude",
    "use_qalora": "QA-LoRA pools the input before lora_A",
    "lora_bias": "a trained bias on lora_B",
    "modules_to_save": "full trained copies of base modules",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on raw nn.Parameters, not on the projections",
    "layer_replication": "a different (replicated) layer stack",
    "megatron_config": "Megatron parallel-linear layers",
    "alora_invocation_tokens": "activated LoRA applies only after the invocation tokens",
    "use_bdlora": "block-diagonal LoRA factors",
    "kasa_config": "KaSA inserts a learned diagonal and truncates the base weight",
    "monteclora_config": "Monte Carlo sampling around the LoRA factors",
    "arrow_config": "Arrow routing between several adapters",
}
# init_lora_weights values whose initialisation rewrites the base weight (PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA):
# PEFT re-runs it on load, so the adapter only matches PEFT on a modified base model.
_BASE_REWRITING_INITS: tuple[str, ...] = ("pissa", "olora", "corda", "loftq", "lora_ga")
_HARMLESS_INITS: tuple[str, ...] = ("gaussian", "eva", "orthogonal", "mica")
# Fields read here or in format.py, and fields ignored because they cannot change inference math.
APPLIED_FIELDS: frozenset[str] = frozenset(
    {"peft_type", "task_type", "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules"}
    | {"layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "bias", "init_lora_weights"}
)
IGNORED_FIELDS: frozenset[str] = frozenset(
    {"lora_dropout", "fan_in_fan_out", "inference_mode", "base_model_name_or_path", "revision"}
    | {"peft_version", "auto_mapping", "loftq_config", "eva_config", "corda_config", "lora_ga_config"}
    | {"velora_config", "qalora_group_size", "megatron_core", "ensure_weight_tying", "runtime_config"}
)


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


def _check_pattern_budget(cfg: dict[str, Any]) -> None:
    """Bound the number and total length of a config's patterns before any is compiled."""
    total = 0
    for name in ("target_modules", "exclude_modules", "layers_pattern"):
        value = cfg.get(name)
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):  # names (matched exactly or as a suffix), or layers patterns
            if len(value) > MAX_PATTERN_KEYS:
                raise AdapterFormatError(f"{name} has {len(value)} entries, more than {MAX_PATTERN_KEYS}")
            if name == "layers_pattern":
                total += sum(len(v) for v in value if isinstance(v, str))
    for name in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(name)
        if isinstance(value, dict):
            if len(value) > MAX_PATTERN_KEYS:
                raise AdapterFormatError(f"{name} has {len(value)} entries, more than {MAX_PATTERN_KEYS}")
            total += sum(len(k) for k in value)
    if total > MAX_TOTAL_PATTERN_CHARS:
        raise AdapterFormatError(
            f"adapter_config.json: its regular expressions have {total} characters together, more than "
            f"{MAX_TOTAL_PATTERN_CHARS}"
        )


def _is_default(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _check_type(cfg: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = cfg.get(name, default)
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise AdapterFormatError(f"adapter_config.json: {name}={value!r} must be {types}, not a bool")
    if not isinstance(value, types):
        raise AdapterFormatError(f"adapter_config.json: {name}={value!r} has type {type(value).__name__}")
    return value


def check_fields(cfg: dict[str, Any]) -> None:
    """Refuse every field whose value changes inference math in a way the engine cannot apply."""
    if cfg.get("peft_type") != "LORA":
        raise AdapterFormatError(f"adapter_config.json: peft_type={cfg.get('peft_type')!r}, expected 'LORA'")
    if cfg.get("task_type") not in (None, "CAUSAL_LM"):
        raise AdapterFormatError(f"task_type={cfg['task_type']!r} is not supported; expected 'CAUSAL_LM'")
    for name, why in REFUSED_WHEN_SET.items():
        if not _is_default(cfg.get(name)):
            raise AdapterFormatError(f"{name}={cfg[name]!r} is not supported ({why})")
    if cfg.get("bias") not in (None, "none"):
        raise AdapterFormatError(f"bias={cfg['bias']!r} is not supported (trained biases); expected 'none'")
    init = cfg.get("init_lora_weights", True)
    if not isinstance(init, bool):
        name = str(init).lower()
        if name.startswith(_BASE_REWRITING_INITS):
            raise AdapterFormatError(
                f"init_lora_weights={init!r} rewrites the base weights, so the adapter needs a modified base "
                "model; re-save it with path_initial_model_for_weight_conversion"
            )
        if name not in _HARMLESS_INITS:
            raise AdapterFormatError(
                f"init_lora_weights={init!r} is unknown; expected a bool or {_HARMLESS_INITS}"
            )
    for name, value in cfg.items():
        if name in APPLIED_FIELDS or name in IGNORED_FIELDS or name in REFUSED_WHEN_SET:
            continue
        # PEFT names LoRA variants `use_*` (flags) or `*_config` (sub-configs): an unknown one that is set
        # probably changes the math, so refuse it; other unknown keys are metadata.
        if (name.startswith("use_") or name.endswith("_config")) and not _is_default(value):
            raise AdapterFormatError(f"unknown LoRA variant field {name}={value!r} is not supported")
        logger.debug("ignoring adapter_config.json metadata field %s", name)


def parse_spec(cfg: dict[str, Any]) -> LoraSpec:
    """Rank, alpha and their per-module patterns, type-checked."""
    _check_pattern_budget(cfg)
    r = _check_type(cfg, "r", int, 8)
    alpha = _check_type(cfg, "lora_alpha", (int, float), 8)
    rank_pattern = _check_type(cfg, "rank_pattern", dict, {}) or {}
    alpha_pattern = _check_type(cfg, "alpha_pattern", dict, {}) or {}
    for key, value in rank_pattern.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise AdapterFormatError(f"rank_pattern[{key!r}]={value!r}, expected a positive int")
    for key, value in alpha_pattern.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise AdapterFormatError(f"alpha_pattern[{key!r}]={value!r}, expected a number")
    if r <= 0:
        raise AdapterFormatError(f"r={r}, expected a positive int")
    cache = PatternCache()
    with cache.timed():
        for name, patterns in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
            for key in patterns:
                _suffix_pattern(cache, key, name)  # refuses what RE2 cannot match as PEFT would
    use_rslora = _check_type(cfg, "use_rslora", bool, False)
    has_velora = not _is_default(cfg.get("velora_config"))
    return LoraSpec(r, float(alpha), use_rslora, dict(rank_pattern), dict(alpha_pattern), has_velora, cache)


def module_keys(base: BaseModelShapes) -> list[str]:
    """Every `named_modules()` key of the transformers *ForCausalLM model for llama/mistral/qwen2."""
    keys = ["", "model", "model.embed_tokens", "model.layers"]
    for i in range(base.num_layers):
        layer = f"model.layers.{i}"
        keys += [layer, f"{layer}.self_attn"]
        keys += [f"{layer}.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        keys += [f"{layer}.mlp"] + [f"{layer}.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
        keys += [f"{layer}.mlp.act_fn", f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    return keys + ["model.norm", "model.rotary_emb", "lm_head"]


def projection_key(layer: int, module: str) -> str:
    """ "model.layers.0.self_attn.q_proj" for (0, "q_proj")."""
    return f"model.layers.{layer}.{_PARENT[module]}.{module}"


def _str_or_list(cfg: dict[str, Any], name: str) -> str | list[str] | None:
    value = cfg.get(name)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise AdapterFormatError(f"adapter_config.json: {name}={value!r}, expected a string or a list of strings")


def _layer_indexes(cfg: dict[str, Any], base: BaseModelShapes) -> list[int] | None:
    value = cfg.get("layers_to_transform")
    if value is None:
        return None
    indexes = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(indexes, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in indexes
    ):
        raise AdapterFormatError(f"layers_to_transform={value!r}, expected an int or a list of ints")
    bad = [i for i in indexes if not 0 <= i < base.num_layers]
    if bad:
        raise AdapterFormatError(
            f"layers_to_transform={value!r} names layers {bad} that do not exist; the base model has "
            f"{base.num_layers} layers (0..{base.num_layers - 1})"
        )
    return indexes


def _layer_index(key: str, layers_pattern: str | list[str] | None, cache: PatternCache) -> int | None:
    # Same regexes as PEFT: the first numbered segment after the layers pattern (any pattern when empty).
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)  # fixed pattern, no tenant input
        return int(match.group("idx")) if match else None
    for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
        found = _layers_regex(cache, pattern).match(key)
        if found is not None:
            return int(found.group(b"idx"))  # RE2 runs on bytes (adapters/safe_regex.py)
    return None


def _layers_regex(cache: PatternCache, pattern: str) -> LinearPattern:
    return cache.get("layers_pattern", pattern, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.")


@dataclass(frozen=True)
class _Targets:
    modules: str | set[str]  # a regex (full match) or names matched exactly or as a dotted suffix
    exclude: str | list[str] | None
    layer_indexes: list[int] | None
    layers_pattern: str | list[str] | None
    patterns: PatternCache = field(default_factory=PatternCache, compare=False, repr=False)

    def matches(self, key: str) -> bool:
        """peft.tuners.tuners_utils.check_target_module_exists, restricted to LoRA's fields."""
        with self.patterns.timed():
            return self._matches(key)

    def _matches(self, key: str) -> bool:
        if isinstance(self.exclude, str):
            if self.patterns.get("exclude_modules", self.exclude).fullmatch(key):
                return False
        elif self.exclude and (key in self.exclude or any(key.endswith(f".{e}") for e in self.exclude)):
            return False
        if isinstance(self.modules, str):
            return self.patterns.get("target_modules", self.modules).fullmatch(key) is not None
        if key in self.modules:  # an exact name skips the layer filter, as in PEFT
            return True
        if not any(key.endswith(f".{t}") for t in self.modules):
            return False
        if not self.layer_indexes:
            return True
        return _layer_index(key, self.layers_pattern, self.patterns) in self.layer_indexes


def _parse_targets(cfg: dict[str, Any], base: BaseModelShapes) -> _Targets:
    _check_pattern_budget(cfg)
    modules = _str_or_list(cfg, "target_modules")
    exclude = _str_or_list(cfg, "exclude_modules")
    layers_pattern = _str_or_list(cfg, "layers_pattern")
    layer_indexes = _layer_indexes(cfg, base)
    if isinstance(modules, str) and (layer_indexes is not None or layers_pattern is not None):
        raise AdapterFormatError(
            "layers_to_transform/layers_pattern cannot be used when target_modules is a str"
        )
    if layers_pattern and layer_indexes is None:
        raise AdapterFormatError(f"layers_pattern={layers_pattern!r} is set without layers_to_transform")
    cache = PatternCache()
    with cache.timed():
        for name, value in (("target_modules", modules), ("exclude_modules", exclude)):
            if isinstance(value, str):
                cache.get(name, value)
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern or []:
            _layers_regex(cache, pattern)
    if modules is None:
        modules = list(DEFAULT_TARGET_MODULES)
    if isinstance(modules, list):
        # PEFT silently drops a list entry that names no module; for us that is an unmapped weight set.
        keys = module_keys(base)
        for name in modules:
            if not any(key == name or key.endswith(f".{name}") for key in keys):
                raise AdapterFormatError(
                    f"target_modules entry {name!r} names no module of a {base.model_type} model; "
                    f"expected projections from {LORA_MODULES}"
                )
    if isinstance(modules, str) and modules.lower() == "all-linear":
        # PEFT expands this to every nn.Linear but the output embedding: exactly the seven projections.
        modules = [projection_key(i, m) for i in range(base.num_layers) for m in LORA_MODULES]
    return _Targets(
        modules if isinstance(modules, str) else set(modules), exclude, layer_indexes, layers_pattern, cache
    )


def resolve_targets(cfg: dict[str, Any], base: BaseModelShapes) -> dict[str, tuple[int, str]]:
    """Module key -> (layer, projection) for every module PEFT would wrap with LoRA on this base model."""
    targets = _parse_targets(cfg, base)
    resolved: dict[str, tuple[int, str]] = {}
    for key in module_keys(base):
        if not targets.matches(key):
            continue
        found = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)", key)
        if found is None or found.group(2) not in LORA_MODULES:
            raise AdapterFormatError(
                f"target_modules={cfg.get('target_modules')!r} selects {key!r}, which is not one of the "
                f"projections {LORA_MODULES}; LoRA on embeddings, lm_head or other modules is not supported"
            )
        resolved[key] = (int(found.group(1)), found.group(2))
    if not resolved:
        raise AdapterFormatError(
            "adapter targets no projection of the base model "
            f"(target_modules={cfg.get('target_modules')!r}, exclude_modules={cfg.get('exclude_modules')!r}, "
            f"layers_to_transform={cfg.get('layers_to_transform')!r}, "
            f"layers_pattern={cfg.get('layers_pattern')!r})"
        )
    return resolved
