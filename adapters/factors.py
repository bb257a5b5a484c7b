"""From a checked weights file to each targeted projection's factors: PEFT tensor names
(`base_model.model.<module key>.lora_A.weight` [r, in], `...lora_B.weight` [out, r], optionally
`.default`) mapped to module keys, every other tensor refused naming the feature it belongs to; shapes
and finiteness checked in the serving dtype, subnormal values flushed to zero; and the bound that keeps
`scale * B (A x)` from overflowing it."""

from __future__ import annotations

import math
import re

import torch

from adapters.peft_targets import EMBEDDING_KEY, LM_HEAD_KEY
from adapters.types import AdapterFormatError, AdapterValidationError, BaseModelShapes

_PREFIX = "base_model.model."
_LORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight")
# PEFT's Embedding LoRA: lora_embedding_A [r, vocab], lora_embedding_B [hidden, r] (saved without ".weight").
_EMBED_TENSOR = re.compile(r"(?P<module>.+)\.lora_embedding_(?P<which>[AB])(?:\.default)?(?:\.weight)?")
# PEFT's default `save_embedding_layers="auto"` also saves the targeted embedding's (or lm_head's) full
# base weight.
_EMBED_COPY_TENSOR = re.compile(r"(?P<module>.+)\.base_layer(?:\.default)?\.weight")
_VELORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_velora_embed(?:\.default)?")
# DoRA's learned magnitude [out_features] (PEFT saves it without ".weight"; older files had ".default").
_MAGNITUDE_TENSOR = re.compile(r"(?P<module>.+)\.lora_magnitude_vector(?:\.default)?(?:\.weight)?")
# Tensor-name fragments PEFT writes for features we refuse, so the error says which feature it was.
_KNOWN_REFUSED = {
    "lora_magnitude_vector": "a DoRA magnitude vector, but adapter_config.json does not set use_dora",
    "lora_embedding_": "LoRA on an embedding",
    ".bias": "a LoRA or base bias (lora_bias / bias)",
    "trainable_tokens": "trainable token rows (trainable_token_indices)",
    "base_layer": "a full base-module weight",
    "modules_to_save": "a full module copy (modules_to_save)",
}


def split_tensors(
    tensors: dict[str, torch.Tensor],
    targets: dict[str, tuple[int, str]],
    base: BaseModelShapes,
    velora: bool,
    dora: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """Module key -> {"A": tensor, "B": tensor[, "M": DoRA magnitude]}; any tensor not for a targeted
    projection is refused."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = name.removeprefix(_PREFIX)
        found = _LORA_TENSOR.fullmatch(key) if name.startswith(_PREFIX) else None
        if found is None and name.startswith(_PREFIX):
            found = _EMBED_TENSOR.fullmatch(key)
        if found is None and name.startswith(_PREFIX) and key in _BASE_COPIES:
            found = _EMBED_COPY_TENSOR.fullmatch(key)
        if found is None and dora and name.startswith(_PREFIX):
            found = _MAGNITUDE_TENSOR.fullmatch(key)
        if found is None:
            if velora and name.startswith(_PREFIX) and _VELORA_TENSOR.fullmatch(key):
                continue  # VeLoRA's buffer only feeds its training-time backward pass
            what = next((why for frag, why in _KNOWN_REFUSED.items() if frag in name), "an unknown tensor")
            raise AdapterFormatError(
                f"tensor {name!r} is {what}; expected only {_PREFIX}<module>.lora_A.weight / .lora_B.weight "
                "(and .lora_embedding_A / _B on embed_tokens, .lora_A / _B on lm_head)"
            )
        module = found.group("module")
        if module not in targets:
            layer = re.match(r"model\.layers\.(\d+)\.", module)
            if layer and int(layer.group(1)) >= base.num_layers:
                raise AdapterFormatError(
                    f"tensor {name!r} is for layer {layer.group(1)}, which does not exist: the base model "
                    f"has {base.num_layers} layers"
                )
            raise AdapterFormatError(
                f"tensor {name!r} is for module {module!r}, which adapter_config.json does not target"
            )
        pair = by_module.setdefault(module, {})
        which = found.groupdict().get("which") or ("W" if "base_layer" in key else "M")
        if which in pair:
            raise AdapterFormatError(f"tensor {name!r} duplicates {_FACTOR_NAMES[which]} of {module!r}")
        pair[which] = tensor
    return by_module


_BASE_COPIES = (f"{EMBEDDING_KEY}.base_layer.weight", f"{LM_HEAD_KEY}.base_layer.weight")
_FACTOR_NAMES = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector", "W": "base_layer.weight"}


def checked_magnitude(
    key: str, module: str, pair: dict[str, torch.Tensor], base: BaseModelShapes, layer: int | None = None
) -> torch.Tensor:
    """DoRA's magnitude of one targeted module as float32 [out_features], finite (the served scale is
    computed from it in float32 whatever the serving dtype)."""
    name = f"{_PREFIX}{key}.lora_magnitude_vector"
    out_features = base.module_shape(module, layer)[1]
    if "M" not in pair:
        raise AdapterFormatError(f"adapter_config.json sets use_dora but tensor {name} is missing")
    magnitude = pair["M"]
    if tuple(magnitude.shape) != (out_features,):
        raise AdapterFormatError(
            f"tensor {name} has shape {tuple(magnitude.shape)}, expected ({out_features},) "
            f"(one magnitude per output feature of the base {module})"
        )
    magnitude = magnitude.to(torch.float32).contiguous()
    if not bool(torch.isfinite(magnitude).all()):
        raise AdapterValidationError(
            f"tensor {name} has non-finite values (expected shape ({out_features},))"
        )
    return magnitude


def checked_factors(
    key: str, module: str, pair: dict[str, torch.Tensor], r: int, base: BaseModelShapes, dtype: torch.dtype,
    layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(A, B) of one targeted module as `dtype`, after checking presence, shapes and finiteness."""
    if "A" not in pair or "B" not in pair:
        missing = [f"{_PREFIX}{key}.lora_{w}.weight" for w in "AB" if w not in pair]
        raise AdapterFormatError(f"adapter_config.json targets {key!r} but tensors {missing} are missing")
    in_features, out_features = base.module_shape(module, layer)
    expected = {"A": (r, in_features), "B": (out_features, r)}  # A [r, in], B [out, r]
    factors = []
    for which in "AB":
        name = f"{_PREFIX}{key}.lora_{which}.weight"
        if tuple(pair[which].shape) != expected[which]:
            raise AdapterFormatError(
                f"tensor {name} has shape {tuple(pair[which].shape)}, expected {expected[which]} "
                f"(r={r}, base {module} in={in_features}, out={out_features})"
            )
        factor = pair[which].to(dtype).contiguous()
        # Checked after the cast, so an fp32 value that overflows the serving dtype is caught too.
        if not bool(torch.isfinite(factor).all()):
            raise AdapterValidationError(f"tensor {name} has non-finite values (checked as {dtype})")
        factors.append(flush_subnormals(factor))
    return factors[0], factors[1]


def checked_embedding(
    key: str, pair: dict[str, torch.Tensor], r: int, base: BaseModelShapes, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, vocab], B [hidden, r]) of an embedding LoRA as `dtype`: present, shaped for the base
    vocabulary (an adapter that adds tokens is refused by name) and finite."""
    names = {w: f"{_PREFIX}{key}.lora_embedding_{w}" for w in "AB"}
    if "A" not in pair or "B" not in pair:
        missing = [names[w] for w in "AB" if w not in pair]
        raise AdapterFormatError(f"adapter_config.json targets {key!r} but tensors {missing} are missing")
    a, b = pair["A"], pair["B"]
    if a.ndim == 2 and a.shape[0] == r and a.shape[1] != base.vocab_size:
        raise AdapterFormatError(
            f"tensor {names['A']} covers a vocabulary of {a.shape[1]} tokens, expected the base model's "
            f"{base.vocab_size}: an adapter that adds or removes tokens needs its own tokenizer, which is "
            "not supported"
        )
    expected = {"A": (r, base.vocab_size), "B": (base.hidden_size, r)}
    factors = []
    for which, tensor in (("A", a), ("B", b)):
        if tuple(tensor.shape) != expected[which]:
            raise AdapterFormatError(
                f"tensor {names[which]} has shape {tuple(tensor.shape)}, expected {expected[which]} "
                f"(r={r}, base vocab={base.vocab_size}, hidden={base.hidden_size})"
            )
        factor = tensor.to(dtype).contiguous()
        if not bool(torch.isfinite(factor).all()):
            raise AdapterValidationError(f"tensor {names[which]} has non-finite values (checked as {dtype})")
        factors.append(flush_subnormals(factor))
    return factors[0], factors[1]


def checked_embedding_copy(
    key: str, pair: dict[str, torch.Tensor], base: BaseModelShapes
) -> torch.Tensor | None:
    """The saved copy of the base embedding (PEFT's `save_embedding_layers`), shape-checked; whether it
    equals the served embedding is checked at load against the base weights (`check_embedding_copy`)."""
    copy = pair.get("W")
    if copy is None:
        return None
    name = f"{_PREFIX}{key}.base_layer.weight"
    expected = (base.vocab_size, base.hidden_size)
    if tuple(copy.shape) != expected:
        raise AdapterFormatError(
            f"tensor {name} has shape {tuple(copy.shape)}, expected {expected} (the base model's vocab x "
            "hidden): a resized embedding needs its own tokenizer, which is not supported"
        )
    return copy


def check_embedding_copy(key: str, copy: torch.Tensor, served: torch.Tensor) -> None:
    """Refuse a saved embedding that differs from the served one (PEFT loads it over the base model, so
    it would replace the embedding: a trained embedding, not a LoRA); compared in the served dtype."""
    served = served.detach().to("cpu")
    differs = copy.to(served.dtype) != served
    if bool(differs.any()):
        rows = torch.nonzero(differs.any(dim=1)).flatten()
        raise AdapterFormatError(
            f"tensor {_PREFIX}{key}.base_layer.weight differs from the served model's embedding in "
            f"{rows.numel()} rows (first {rows[:4].tolist()}): a trained or replaced embedding is not "
            "supported; expected the base weights, or save the adapter with save_embedding_layers=False"
        )


def check_embedding_bound(
    key: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> None:
    """Refuse an embedding LoRA whose per-token delta `scale * B A[:, t]` can overflow `dtype`:
    |scale| * ||B||_inf * max|A| (times the largest embedding multiplier, sqrt(hidden) on Gemma, which
    the engine applies after) must stay <= finfo.max / sqrt(hidden)."""
    if not math.isfinite(scale):
        raise AdapterValidationError(f"{key}: scale {scale} (from lora_alpha / r) is not a finite number")
    limit = torch.finfo(dtype).max / math.sqrt(b.shape[0])
    delta = abs(scale) * float(b.double().abs().sum(dim=1).max()) * float(a.double().abs().max())
    if not delta <= limit:
        raise AdapterValidationError(
            f"{key}: the embedding LoRA delta can overflow {dtype}: |scale| * ||B||_inf * max|A| = "
            f"{delta:.3g}; expected <= {limit:.3g} (finfo.max / sqrt(hidden))"
        )


def flush_subnormals(factor: torch.Tensor) -> torch.Tensor:
    """`factor` with its subnormal values (0 < |v| < finfo(dtype).tiny) set to zero, or `factor` itself
    when it has none. They change a delta by less than the dtype can tell from zero next to any
    normal activation, and on CPUs without fast denormal arithmetic every matmul that reads them runs
    several times slower (measured: a co-batched victim's decode 4.2x slower) - for every request of
    the step, not only the adapter's. The engine thread also flushes denormals that arise on the way
    (`torch.set_flush_denormal`, base_engine/async_engine.py)."""
    is_subnormal = (factor != 0) & (factor.abs() < torch.finfo(factor.dtype).tiny)
    if not bool(is_subnormal.any()):
        return factor  # a view of the mapped file stays a view: nothing copied
    return factor.masked_fill(is_subnormal, 0)


def max_activation(dtype: torch.dtype) -> float:
    """The largest hidden-state magnitude the delta bound allows for: 2^16 (far above what real
    checkpoints reach) or sqrt(max) of the serving dtype, whichever is smaller (256 for fp16)."""
    return min(65536.0, math.sqrt(torch.finfo(dtype).max))


def check_delta_bound(key: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
    """Refuse factors whose delta can overflow `dtype` for an input with |x_j| <= max_activation.

    With infinity norms (max absolute row sum; submultiplicative, so a bound without forming B @ A):
    shrink |A x| <= ||A|| X and delta |scale B A x| <= |scale| ||B|| ||A|| X must stay <= finfo.max.
    A NaN/Inf lora_alpha (JSON allows both) fails the same check.
    """
    limit = torch.finfo(dtype).max
    x_max = max_activation(dtype)
    norm_a = float(a.double().abs().sum(dim=1).max())  # ||A||_inf, A [r, in]
    norm_b = float(b.double().abs().sum(dim=1).max())  # ||B||_inf, B [out, r]
    if not math.isfinite(scale):
        raise AdapterValidationError(f"{key}: scale {scale} (from lora_alpha / r) is not a finite number")
    shrink, delta = norm_a * x_max, abs(scale) * norm_b * norm_a * x_max
    if not (shrink <= limit and delta <= limit):
        raise AdapterValidationError(
            f"{key}: the LoRA delta can overflow {dtype}: |scale| * ||B||_inf * ||A||_inf * {x_max:g} = "
            f"{delta:.3g} (and ||A||_inf * {x_max:g} = {shrink:.3g}); expected both <= {limit:.3g}"
        )
