"""Which modules a PEFT LoRA config targets on a llama/mistral/qwen2/qwen3/phi3 base model, following
`peft.tuners.tuners_utils.check_target_module_exists`: a `target_modules` string is a regex full match, a
list matches exact names or `.`-suffixes, `exclude_modules` first, then `layers_to_transform` /
`layers_pattern`. Tenant regexes are matched by RE2 (adapters/safe_regex.py); anything outside the
model's projections (the seven, or Phi-3's fused qkv_proj, o_proj, gate_up_proj, down_proj) and the input
embedding (`model.embed_tokens`, resolved to `EMBEDDING_TARGET`) and the LM head (`lm_head`,
`LM_HEAD_TARGET`) is refused."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from adapters.expert_layouts import (
    FUSED,
    PER_EXPERT,
    per_expert_linear_keys,
    per_expert_module_keys,
    per_expert_target,
)
from adapters.peft_fields import check_pattern_budget
from adapters.safe_regex import LinearPattern, PatternCache
from adapters.types import FUSED_MODEL_TYPES, FUSED_PROJECTIONS, AdapterFormatError, BaseModelShapes

# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING entry for llama/mistral/qwen2, used when the
# saved config has `target_modules: null`; PEFT has no entry for phi3 (it raises "Please specify
# `target_modules`"), nor do we.
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("q_proj", "v_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_PARENT |= {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
# The input embedding: LoRA on it is PEFT's `Embedding` layer (lora_embedding_A / _B), not a projection.
EMBEDDING_KEY = "model.embed_tokens"
EMBEDDING_TARGET: tuple[int, str] = (-1, "embed_tokens")
# The output embedding: LoRA on it is PEFT's `Linear` on `lm_head` (lora_A [r, hidden], lora_B [vocab, r]).
LM_HEAD_KEY = "lm_head"
LM_HEAD_TARGET: tuple[int, str] = (-1, "lm_head")
# Model types PEFT has no default target_modules for (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
NO_DEFAULT_TARGETS: tuple[str, ...] = ("phi3", "qwen3_moe", "qwen2_moe")
# Model types whose attention holds q_norm / k_norm modules (a pattern that selects them is refused).
QK_NORM_MODEL_TYPES: tuple[str, ...] = ("qwen3", "gemma3_text", "qwen3_moe")
# Gemma 2 / 3 layers norm before and after both attention and the MLP.
GEMMA_MODEL_TYPES: tuple[str, ...] = ("gemma2", "gemma3_text")


def module_keys(base: BaseModelShapes, layout: str = FUSED) -> list[str]:
    """Every `named_modules()` key of transformers' *ForCausalLM for the served families
    (the order within a layer aside); `layout` PER_EXPERT: MoE layers as transformers 4 built them."""
    fused = base.model_type in FUSED_MODEL_TYPES
    keys = ["", "model", "model.embed_tokens", "model.layers"]
    for i in range(base.num_layers):
        layer = f"model.layers.{i}"
        # In transformers' module order (Phi3Attention creates o_proj before qkv_proj).
        attention = ("o_proj", "qkv_proj") if fused else ("q_proj", "k_proj", "v_proj", "o_proj")
        mlp = (
            ("gate_up_proj", "down_proj", "activation_fn")
            if fused
            else ("gate_proj", "up_proj", "down_proj", "act_fn")
        )
        keys += [layer, f"{layer}.self_attn"] + [f"{layer}.self_attn.{m}" for m in attention]
        if base.model_type in QK_NORM_MODEL_TYPES:
            keys += [f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm"]
        dense = [f"{layer}.mlp.{m}" for m in mlp]
        keys += [f"{layer}.mlp"] + (_moe_keys(base, i, layout) if base.is_sparse(i) else dense)
        keys += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
        if base.model_type in GEMMA_MODEL_TYPES:
            keys += [f"{layer}.pre_feedforward_layernorm", f"{layer}.post_feedforward_layernorm"]
        if fused:  # Phi3DecoderLayer's dropouts
            keys += [f"{layer}.resid_attn_dropout", f"{layer}.resid_mlp_dropout"]
    return keys + ["model.norm", "model.rotary_emb", "lm_head"]


def _moe_keys(base: BaseModelShapes, layer: int, layout: str) -> list[str]:
    """An MoE layer's MLP modules (transformers 5: the router `gate` and the fused `experts` hold no
    nn.Linear; Qwen2-MoE's shared expert is a SwiGLU MLP and its gate an nn.Linear)."""
    mlp = f"model.layers.{layer}.mlp"
    if layout == PER_EXPERT:
        keys = per_expert_module_keys(base, layer)
    else:
        keys = [f"{mlp}.gate", f"{mlp}.experts", f"{mlp}.experts.act_fn"]
    if base.moe_shared_size is not None:
        shared = f"{mlp}.shared_expert"
        keys += [shared] + [f"{shared}.{m}" for m in ("gate_proj", "up_proj", "down_proj", "act_fn")]
        keys.append(f"{mlp}.shared_expert_gate")
    return keys


# MoE modules a target may select that are not served as LoRA targets, and why.
_MOE_REFUSED = {
    "gate": "the MoE router, which is no nn.Linear: PEFT wraps its weight with target_parameters "
    "['mlp.gate.weight']",
    "experts": "the fused experts, which hold no nn.Linear: target their tensors with target_parameters "
    "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']",
}


def _moe_hint(base: BaseModelShapes, name: str) -> str:
    if base.moe is None or name.rsplit(".", 1)[-1] not in ("gate_proj", "up_proj", "down_proj"):
        return ""
    return (
        f" ({base.model_type} routes its MLP to experts: target their tensors with target_parameters "
        "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])"
    )


def linear_keys(base: BaseModelShapes, layout: str = FUSED) -> list[str]:
    """What PEFT's "all-linear" expands to: every nn.Linear but the LM head."""
    keys = []
    for i in range(base.num_layers):
        for m in base.projections:
            if _PARENT[m] == "self_attn" or not base.is_sparse(i):
                keys.append(projection_key(i, m))
        if base.is_sparse(i) and layout == PER_EXPERT:
            keys += per_expert_linear_keys(base, i)
        if base.is_sparse(i) and base.moe_shared_size is not None:
            shared = f"model.layers.{i}.mlp.shared_expert"
            keys += [f"{shared}.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
            keys.append(f"model.layers.{i}.mlp.shared_expert_gate")
    return keys


def _fused_hint(base: BaseModelShapes, name: str | None = None) -> str:
    """Why a q_proj-style name finds nothing on a fused model: ' (phi3 fuses q_proj, k_proj, v_proj
    into qkv_proj: target the fused names)'; without a name, both fusions."""
    if base.model_type not in FUSED_MODEL_TYPES:
        return ""
    fusions = [
        (fused, parts)
        for fused, parts in FUSED_PROJECTIONS.items()
        if name is None or name.rsplit(".", 1)[-1] in parts
    ]
    if not fusions:
        return ""
    said = "; ".join(f"{', '.join(parts)} into {fused}" for fused, parts in fusions)
    return f" ({base.model_type} fuses {said}: target the fused names)"


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


def _parse_targets(cfg: dict[str, Any], base: BaseModelShapes, allow_empty: bool, layout: str) -> _Targets:
    check_pattern_budget(cfg)
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
    if modules is None and base.model_type in NO_DEFAULT_TARGETS and allow_empty:
        modules = []  # PEFT leaves target_modules unset when target_parameters names what to wrap
    if modules is None:
        if base.model_type in NO_DEFAULT_TARGETS:
            raise AdapterFormatError(
                f"adapter_config.json: target_modules is null and PEFT has no default targets for "
                f"{base.model_type}; expected a list from {base.projections}"
            )
        modules = list(DEFAULT_TARGET_MODULES)
    if isinstance(modules, list):
        # PEFT silently drops a list entry that names no module; for us that is an unmapped weight set.
        keys = module_keys(base, layout)
        for name in modules:
            if not any(key == name or key.endswith(f".{name}") for key in keys):
                raise AdapterFormatError(
                    f"target_modules entry {name!r} names no module of a {base.model_type} model; "
                    f"expected projections from {base.projections}{_fused_hint(base, name)}"
                    f"{_moe_hint(base, name)}"
                )
    if isinstance(modules, str) and modules.lower() == "all-linear":
        # PEFT expands this to every nn.Linear but the output embedding: exactly the projections.
        modules = linear_keys(base, layout)
    return _Targets(
        modules if isinstance(modules, str) else set(modules), exclude, layer_indexes, layers_pattern, cache
    )


def resolve_targets(
    cfg: dict[str, Any], base: BaseModelShapes, allow_empty: bool = False, layout: str = FUSED
) -> dict[str, tuple[int, str]]:
    """Module key -> (layer, projection) for every module PEFT would wrap with LoRA on this base model;
    the input embedding maps to `EMBEDDING_TARGET`, the LM head to `LM_HEAD_TARGET`. `allow_empty`: no
    module may be targeted (target_parameters names what the adapter wraps). `layout` PER_EXPERT (an
    adapter saved on transformers 4, adapters/experts_v4.py): an expert's module maps to
    "experts.N.<part>", the router (an nn.Linear then) to "router"."""
    targets = _parse_targets(cfg, base, allow_empty, layout)
    resolved: dict[str, tuple[int, str]] = {}
    for key in module_keys(base, layout):
        if not targets.matches(key):
            continue
        if key in (EMBEDDING_KEY, LM_HEAD_KEY):
            resolved[key] = EMBEDDING_TARGET if key == EMBEDDING_KEY else LM_HEAD_TARGET
            continue
        expert = per_expert_target(key) if layout == PER_EXPERT else None
        if expert is not None:
            resolved[key] = expert
            continue
        found = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp|mlp\.shared_expert)\.(\w+)", key)
        if found is not None and found.group(2) == "shared_expert_gate" and base.moe_shared_size is not None:
            resolved[key] = (int(found.group(1)), "shared_expert_gate")
            continue
        moe_part = re.fullmatch(r"model\.layers\.\d+\.mlp\.(\w+)", key)
        if moe_part is not None and moe_part.group(1) in _MOE_REFUSED:
            raise AdapterFormatError(
                f"target_modules={cfg.get('target_modules')!r} selects {key!r}, "
                f"{_MOE_REFUSED[moe_part.group(1)]}"
            )
        if found is None or found.group(2) not in base.projections:
            raise AdapterFormatError(
                f"target_modules={cfg.get('target_modules')!r} selects {key!r}, which is not one of the "
                f"projections {base.projections}, {EMBEDDING_KEY!r} or {LM_HEAD_KEY!r}; LoRA on norms or "
                "other modules is not supported"
            )
        resolved[key] = (int(found.group(1)), found.group(2))
    if not resolved and not allow_empty:
        raise AdapterFormatError(
            f"adapter targets no projection of the base model{_fused_hint(base)} "
            f"(target_modules={cfg.get('target_modules')!r}, exclude_modules={cfg.get('exclude_modules')!r}, "
            f"layers_to_transform={cfg.get('layers_to_transform')!r}, "
            f"layers_pattern={cfg.get('layers_pattern')!r})"
        )
    return resolved
