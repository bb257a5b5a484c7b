"""Load a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) onto a base model.

Format: Hugging Face PEFT `save_pretrained` (peft 0.21). Tensors are named
`base_model.model.<module key>.lora_A.weight` ([r, in_features]) and `...lora_B.weight`
([out_features, r]), optionally with the adapter name (`lora_A.default.weight`). PEFT's forward is
`y = W x + scale * B (A x)` for every targeted nn.Linear, whatever `fan_in_fan_out` says: PEFT resets
that flag to False on nn.Linear, and it only ever transposes the *merged* delta, never A or B, so
neither do we. LoRA: Hu et al. 2021, arXiv:2106.09685. Safetensors: huggingface/safetensors format
(8-byte little-endian header length, JSON header, raw little-endian data).

Pickle (`adapter_model.bin`) is never loaded. DoRA (`use_dora`, Liu et al. 2024, arXiv:2402.09353)
adds `...lora_magnitude_vector` [out_features] per module (checked here; the served scale needs the base
weights and is computed at load, adapters/dora.py). Embedding LoRA on `embed_tokens`:
`...lora_embedding_A` [r, vocab] and `...lora_embedding_B` [hidden, r] (`LoraAdapter.embedding`).
lm_head LoRA: `lm_head.lora_A.weight` [r, hidden], `lm_head.lora_B.weight` [vocab, r] (`LoraAdapter.lm_head`).
Anything else PEFT would apply differently from `W x + scale * B A x` on the seven projections is
refused with an `AdapterFormatError` naming the field or tensor (see adapters/README.md).

The steps live next to this module: files.py reads the two files, safetensors_header.py checks the
weights' header (and maps tensors without copying), factors.py maps tensor names to projections and
checks shapes, finiteness and the overflow bound.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from adapters.expert_layouts import FUSED, expert_layout, is_per_expert
from adapters.experts import expert_pairs, take_expert_tensors
from adapters.experts_v4 import ExpertFactors, fuse_per_expert
from adapters.factors import (
    check_delta_bound,
    check_embedding_bound,
    checked_embedding,
    checked_embedding_copy,
    checked_factors,
    checked_magnitude,
    split_tensors,
)
from adapters.files import WEIGHTS_NAME, AdapterFiles, read_adapter_files
from adapters.lm_head import check_weight_tying, checked_head_copy, checked_lm_head
from adapters.peft_fields import SUPPORTED_MODEL_TYPES, check_fields, check_type
from adapters.peft_params import resolve_parameters
from adapters.peft_rank import LoraSpec, parse_spec
from adapters.peft_targets import EMBEDDING_TARGET, LM_HEAD_TARGET, resolve_targets
from adapters.replacements import replaced_modules, take_replacements
from adapters.safetensors_header import check_header, mapped_tensors
from adapters.types import (
    EXPERT_MODULES,
    FUSED_PROJECTIONS,
    LORA_MODULES,
    MOE_GATES,
    AdapterFormatError,
    AdapterValidationError,
    BaseModelShapes,
)


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One projection's LoRA factors: delta_W = scale * b @ a; with DoRA, y = out_scale * (W x + delta_W x)
    (+ out_shift), computed from `magnitude` and the base weight at load (adapters/dora.py)."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, after rank/alpha patterns
    magnitude: torch.Tensor | None = None  # DoRA's m [out_features] float32, as parsed
    out_scale: torch.Tensor | None = None  # DoRA's m / ||W + scale * b @ a||_row [out_features] float32
    out_shift: torch.Tensor | None = None  # (1 - out_scale) * bias [out_features] float32 (bias kept as is)


@dataclass(frozen=True)
class LoraAdapter:
    """A parsed adapter: factors keyed by (layer index, projection name in LORA_MODULES)."""

    rank_by_module: dict[str, int]  # projection -> rank, max over layers
    max_rank: int  # over the projections and the embedding
    weights: dict[tuple[int, str], LoraPair]
    # Embedding LoRA (PEFT's lora_embedding_A [r, vocab] as `a`, lora_embedding_B [hidden, r] as `b`):
    # the looked-up row of token t gains scale * b @ a[:, t].
    embedding: LoraPair | None = None
    # The base embedding PEFT saved beside it (save_embedding_layers), until the cache has checked it
    # equals the served one at load (adapters/embedding.py), which drops it.
    embedding_copy: torch.Tensor | None = None
    # lm_head LoRA (lora_A [r, hidden] as `a`, lora_B [vocab, r] as `b`): each row's logits gain
    # scale * b @ (a @ h); `lm_head_copy` is the base head PEFT saved beside it, dropped at load.
    lm_head: LoraPair | None = None
    lm_head_copy: torch.Tensor | None = None
    # modules_to_save (adapters/replacements.py): "lm_head" / "embed_tokens" -> the adapter's own
    # [vocab, hidden] matrix, which replaces the base module for its rows.
    replacements: dict[str, torch.Tensor] = field(default_factory=dict)
    # LoRA on MoE expert tensors (adapters/experts.py): (layer, one of EXPERT_MODULES) -> a pair whose
    # `a` is [E, r, in] and `b` [E, out, r], one delta per expert.
    experts: dict[tuple[int, str], LoraPair] = field(default_factory=dict)

    @property
    def modules(self) -> tuple[str, ...]:
        """Covered projections, in LORA_MODULES order."""
        return tuple(m for m in LORA_MODULES if m in self.rank_by_module)

    @property
    def is_dora(self) -> bool:
        return any(p.magnitude is not None or p.out_scale is not None for p in self.weights.values())

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in (*self.weights, *self.experts)}))


def parse_adapter(
    files: AdapterFiles,
    *,
    base: BaseModelShapes,
    dtype: torch.dtype = torch.float32,
    max_lora_rank: int | None = None,
    max_replacement_bytes: int | None = None,
) -> LoraAdapter:
    """Check `files` against `base` and return the factors as `dtype` (see module docstring)."""
    if base.model_type not in SUPPORTED_MODEL_TYPES:
        raise AdapterFormatError(
            f"base model_type={base.model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    check_fields(files.config)
    use_dora = bool(check_type(files.config, "use_dora", (bool, type(None)), False))
    spec = parse_spec(files.config)
    params = resolve_parameters(files.config, base)
    tensors = _tensors(files)
    layout = expert_layout(tensors) if base.moe is not None else FUSED
    targets = resolve_targets(files.config, base, allow_empty=bool(params), layout=layout)
    expert_targets, rank_keys = _add_parameter_targets(params, targets, use_dora)
    replaced = replaced_modules(files.config, base, targets)
    check_weight_tying(files.config, tensors)
    replacements = take_replacements(tensors, replaced, base, dtype, max_replacement_bytes)
    experts = _experts(take_expert_tensors(tensors, expert_targets), expert_targets, spec, base, dtype,
                       max_lora_rank)  # fmt: skip
    by_module = split_tensors(tensors, targets, base, spec.has_velora, dora=use_dora)
    weights: dict[tuple[int, str], LoraPair] = {}
    embedding = embedding_copy = lm_head = lm_head_copy = None
    per_expert: dict[tuple[int, str], ExpertFactors] = {}
    for key, (layer, module) in targets.items():
        r, scale = spec.rank_and_scale(rank_keys.get(key, key))
        if max_lora_rank is not None and r > max_lora_rank:
            raise AdapterValidationError(f"{key} has rank {r}, above max_lora_rank={max_lora_rank}")
        factors = by_module.get(key, {})
        if is_per_expert(module):
            per_expert[(layer, module)] = (key, factors, r, scale)
            continue
        if (layer, module) == EMBEDDING_TARGET:
            embedding = _embedding_pair(key, factors, r, scale, base, dtype, use_dora)
            embedding_copy = checked_embedding_copy(key, factors, base)
            continue
        if (layer, module) == LM_HEAD_TARGET:
            lm_head = _lm_head_pair(key, factors, r, scale, base, dtype, use_dora)
            lm_head_copy = checked_head_copy(key, factors, base)
            continue
        a, b = checked_factors(key, module, factors, r, base, dtype, layer)
        check_delta_bound(key, a, b, scale, dtype)
        magnitude = checked_magnitude(key, module, factors, base, layer) if use_dora else None
        pair = LoraPair(a=a, b=b, scale=scale, magnitude=magnitude)
        weights.update(_split_fused(layer, module, pair, base))
    experts |= _fused_per_expert(per_expert, experts, base, dtype, max_lora_rank, use_dora)
    ranks: dict[str, int] = {}
    for (_, module), pair in weights.items():
        ranks[module] = max(ranks.get(module, 0), pair.a.shape[0])
    for (_, module), pair in experts.items():
        ranks[module] = max(ranks.get(module, 0), pair.a.shape[1])
    rank_by_module = {m: ranks[m] for m in (*LORA_MODULES, *MOE_GATES, *EXPERT_MODULES) if m in ranks}
    extra = [p.a.shape[0] for p in (embedding, lm_head) if p is not None]
    max_rank = max([*ranks.values(), *extra])
    return LoraAdapter(
        rank_by_module=rank_by_module, max_rank=max_rank, weights=weights, embedding=embedding,
        embedding_copy=embedding_copy, lm_head=lm_head, lm_head_copy=lm_head_copy, replacements=replacements,
        experts=experts,
    )  # fmt: skip


def _tensors(files: AdapterFiles) -> dict[str, torch.Tensor]:
    check_header(files.weights_bytes)
    try:
        if isinstance(files.weights_bytes, mmap.mmap):
            return mapped_tensors(files.weights_bytes)
        return load_safetensors(files.weights_bytes)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterFormatError(f"{WEIGHTS_NAME} could not be parsed: {exc}") from exc


def _fused_per_expert(
    found: dict[tuple[int, str], ExpertFactors], experts: dict[tuple[int, str], LoraPair],
    base: BaseModelShapes, dtype: torch.dtype, max_lora_rank: int | None, use_dora: bool,
) -> dict[tuple[int, str], LoraPair]:  # fmt: skip
    """The transformers-4 per-expert pairs (adapters/experts_v4.py) on the fused expert tensors."""
    if not found:
        return {}
    if use_dora:
        raise AdapterFormatError(
            "use_dora on the per-expert modules of an adapter saved on transformers 4: DoRA on experts is "
            "not served (transformers 5 fuses them; PEFT's ParamWrapper has no DoRA); expected use_dora "
            "only on attention or dense MLP projections"
        )
    fused = fuse_per_expert(found, base, dtype)
    out = {}
    for (layer, module), (a, b, scale) in fused.items():
        if (layer, module) in experts:
            raise AdapterFormatError(
                f"layer {layer}'s {module} has LoRA both per expert and through target_parameters; "
                "expected one of them"
            )
        if max_lora_rank is not None and a.shape[1] > max_lora_rank:
            raise AdapterValidationError(
                f"layer {layer}'s {module}: the fused rank is {a.shape[1]} (gate and up ranks add up, as "
                f"PEFT fuses them), above max_lora_rank={max_lora_rank}"
            )
        out[(layer, module)] = LoraPair(a=a, b=b, scale=scale)
    return out


def _add_parameter_targets(
    params: dict[str, tuple[int, str]], targets: dict[str, tuple[int, str]], use_dora: bool
) -> tuple[dict[str, tuple[int, str]], dict[str, str]]:
    """Fold target_parameters into `targets`: a projection's weight is LoRA on its module (its rank and
    alpha patterns looked up with the parameter key, as PEFT does); the expert tensors are returned."""
    if params and use_dora:
        raise AdapterFormatError(
            "use_dora with target_parameters: PEFT's ParamWrapper does not support DoRA; expected use_dora "
            "only with target_modules"
        )
    experts, rank_keys = {}, {}
    for key, (layer, module) in params.items():
        if module in EXPERT_MODULES:
            experts[key] = (layer, module)
            continue
        module_key = key.removesuffix(".weight")
        if module_key in targets:
            raise AdapterFormatError(
                f"{module_key!r} is targeted by both target_modules and target_parameters; PEFT refuses "
                "that too (expected each module in one of them)"
            )
        targets[module_key] = (layer, module)
        rank_keys[module_key] = key
    return experts, rank_keys


def _experts(
    found: dict[tuple[int, str], dict[str, torch.Tensor]], targets: dict[str, tuple[int, str]],
    spec: LoraSpec, base: BaseModelShapes, dtype: torch.dtype, max_lora_rank: int | None,
) -> dict[tuple[int, str], LoraPair]:  # fmt: skip
    ranks = {key: spec.rank_and_scale(key) for key in targets}
    for key, (r, _) in ranks.items():
        if max_lora_rank is not None and r > max_lora_rank:
            raise AdapterValidationError(f"{key} has rank {r}, above max_lora_rank={max_lora_rank}")
    pairs = expert_pairs(found, targets, ranks, base, dtype)
    return {k: LoraPair(a=a, b=b, scale=scale) for k, (a, b, scale) in pairs.items()}


def _embedding_pair(
    key: str, factors: dict[str, torch.Tensor], r: int, scale: float, base: BaseModelShapes,
    dtype: torch.dtype, use_dora: bool,
) -> LoraPair:  # fmt: skip
    """The checked embedding LoRA; DoRA on an embedding (PEFT's DoraEmbeddingVariant) is refused."""
    if use_dora:
        raise AdapterFormatError(
            f"use_dora with {key!r} targeted: DoRA on an embedding is not supported; expected use_dora "
            "only with projections targeted"
        )
    a, b = checked_embedding(key, factors, r, base, dtype)
    check_embedding_bound(key, a, b, scale, dtype)
    return LoraPair(a=a, b=b, scale=scale)


def _lm_head_pair(
    key: str, factors: dict[str, torch.Tensor], r: int, scale: float, base: BaseModelShapes,
    dtype: torch.dtype, use_dora: bool,
) -> LoraPair:  # fmt: skip
    """The checked lm_head LoRA; DoRA on the LM head is refused (its norm would be per vocabulary row)."""
    if use_dora:
        raise AdapterFormatError(
            f"use_dora with {key!r} targeted: DoRA on the LM head is not supported; expected use_dora "
            "only with projections targeted"
        )
    a, b = checked_lm_head(key, factors, r, base, dtype)
    check_delta_bound(key, a, b, scale, dtype)
    return LoraPair(a=a, b=b, scale=scale)


def _split_fused(
    layer: int, module: str, pair: LoraPair, base: BaseModelShapes
) -> dict[tuple[int, str], LoraPair]:
    """A LoRA on a fused projection (Phi-3's qkv_proj: delta = scale * B A x, B [q + k + v, r]) as one pair
    per part with the same A and B's rows for that part: the parts' deltas are exactly the fused one's
    rows, which is the layout the slot pool stacks per packed projection. A DoRA magnitude is split by
    the same rows: its norm is per output row, so each part's rows keep their own."""
    parts = FUSED_PROJECTIONS.get(module)
    if parts is None:
        return {(layer, module): pair}
    sizes = [base.module_shape(part)[1] for part in parts]
    rows = pair.b.split(sizes, dim=0)
    magnitudes = [None] * len(parts) if pair.magnitude is None else pair.magnitude.split(sizes)
    return {
        (layer, part): LoraPair(a=pair.a, b=b.contiguous(), scale=pair.scale, magnitude=m)
        for part, b, m in zip(parts, rows, magnitudes, strict=True)
    }


def load_adapter(
    adapter_dir: Path,
    *,
    base: BaseModelShapes,
    dtype: torch.dtype = torch.float32,
    max_lora_rank: int | None = None,
    max_replacement_bytes: int | None = None,
) -> LoraAdapter:
    """Read a PEFT LoRA directory on CPU and check it against `base`; raises AdapterFormatError."""
    return parse_adapter(
        read_adapter_files(adapter_dir), base=base, dtype=dtype, max_lora_rank=max_lora_rank,
        max_replacement_bytes=max_replacement_bytes,
    )  # fmt: skip
