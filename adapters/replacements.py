"""PEFT `modules_to_save` on `lm_head` and `embed_tokens`: a full trained copy of the module per adapter.

PEFT matches each `modules_to_save` entry as a plain suffix of the module key (`key.endswith(entry)`),
wraps the matched module in a `ModulesToSaveWrapper` (the copy replaces the module for that adapter; on
a tied model only the listed one: the other keeps the base weight) and saves the copy under the module's
own name, `base_model.model.lm_head.weight` / `base_model.model.model.embed_tokens.weight`, [vocab,
hidden]. The engine reads each row's own matrix (base_engine/lora.py `head_groups`, `replace_embedding`).
Norms (`input_layernorm`, `post_attention_layernorm`, Gemma's pre/post feed-forward norms, `model.norm`,
q/k norms): the copy's weight vector (kept under the module key) replaces the norm's weight for the
adapter's rows (`apply_norm`).

Refused by name: entries matching any other module (merge the adapter, or train without it), a module
that is also a LoRA target, a missing or misshapen copy, a larger vocabulary (added tokens need
their own tokenizer; out of scope), non-finite values, and copies whose bytes exceed the configured
budget (`max_replacement_bytes`, with the figures)."""

from __future__ import annotations

import re
from typing import Any

import torch

from adapters.factors import _PREFIX
from adapters.peft_targets import EMBEDDING_KEY, LM_HEAD_KEY, module_keys
from adapters.types import AdapterFormatError, AdapterValidationError, BaseModelShapes

# Module key -> the short name the engine and the coverage report use.
REPLACEABLE: dict[str, str] = {LM_HEAD_KEY: "lm_head", EMBEDDING_KEY: "embed_tokens"}
# Norms whose weight a modules_to_save copy may replace, kept under their module key.
_NORM = re.compile(
    r"model\.norm|model\.layers\.\d+\.(?:input_layernorm|post_attention_layernorm|pre_feedforward_layernorm"
    r"|post_feedforward_layernorm|self_attn\.q_norm|self_attn\.k_norm)"
)
# The default per-adapter budget for replacement matrices (a Llama-3-8B lm_head in bf16 is ~1.05 GB).
DEFAULT_MAX_REPLACEMENT_BYTES = 2 << 30


def replaceable_norm(key: str) -> bool:
    """Whether module `key` is a norm a modules_to_save copy may replace."""
    return _NORM.fullmatch(key) is not None


def replaced_modules(cfg: dict[str, Any], base: BaseModelShapes, targets: dict[str, Any]) -> list[str]:
    """Module keys `modules_to_save` selects (PEFT's suffix match); refuses anything but lm_head and
    embed_tokens, and a module that is also a LoRA target."""
    entries = cfg.get("modules_to_save")
    if entries is None or entries == []:
        return []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise AdapterFormatError(f"modules_to_save={entries!r}, expected a list of module names")
    keys = [k for k in module_keys(base) if k and any(k.endswith(e) for e in entries)]
    other = [k for k in keys if k not in REPLACEABLE and not replaceable_norm(k)]
    if other:
        raise AdapterFormatError(
            f"modules_to_save={entries!r} selects {other[:4]}: a trained copy of that module is not served "
            "(only lm_head, embed_tokens and norms are); merge the adapter into the base model and "
            "serve that, or train without modules_to_save on it"
        )
    if not keys:
        raise AdapterFormatError(
            f"modules_to_save={entries!r} names no module of a {base.model_type} model; expected "
            f"{sorted(REPLACEABLE.values())}"
        )
    if cfg.get("ensure_weight_tying") and any(k in REPLACEABLE for k in keys):
        raise AdapterFormatError(
            f"ensure_weight_tying=true with modules_to_save={entries!r}: copies tied between embed_tokens "
            "and lm_head are not supported; expected ensure_weight_tying false"
        )
    both = [k for k in keys if k in targets]
    if both:
        raise AdapterFormatError(
            f"{both} is both in modules_to_save and a LoRA target; expected one or the other"
        )
    return keys


def take_replacements(
    tensors: dict[str, torch.Tensor],
    keys: list[str],
    base: BaseModelShapes,
    dtype: torch.dtype,
    max_bytes: int | None,
) -> dict[str, torch.Tensor]:
    """Pop each selected module's copy out of `tensors`, checked: name, [vocab, hidden], finite, budget.
    Returns short name -> matrix as `dtype`."""
    element = torch.empty((), dtype=dtype).element_size()
    needed = sum(_numel(replacement_shape(k, base)) for k in keys) * element
    if max_bytes is not None and needed > max_bytes:
        shapes = ", ".join(f"{REPLACEABLE.get(k, k)} {list(replacement_shape(k, base))}" for k in keys)
        raise AdapterValidationError(
            f"modules_to_save replacements need {needed} bytes ({shapes} as {dtype}), above the budget of "
            f"{max_bytes} bytes per adapter; raise max_replacement_bytes (LORASERVE_MAX_REPLACEMENT_BYTES) "
            "to serve it"
        )
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        name = f"{_PREFIX}{key}.weight"
        tensor = tensors.pop(name, None)
        if tensor is None:
            raise AdapterFormatError(
                f"modules_to_save selects {key!r} but tensor {name} is missing (PEFT saves the trained copy "
                "under the module's own name)"
            )
        shape, expected = tuple(tensor.shape), replacement_shape(key, base)
        if key not in REPLACEABLE:
            if shape != expected:
                raise AdapterFormatError(
                    f"tensor {name} has shape {shape}, expected {expected} (the norm's weight)"
                )
        elif len(shape) == 2 and shape[1] == expected[1] and shape[0] > expected[0]:
            raise AdapterFormatError(
                f"tensor {name} has {shape[0]} rows, more than the base model's vocabulary of {expected[0]}: "
                "an adapter that adds tokens needs its own tokenizer; out of scope"
            )
        if shape != expected:
            raise AdapterFormatError(
                f"tensor {name} has shape {shape}, expected {expected} ([vocab, hidden] of the base model)"
            )
        matrix = tensor.to(dtype).contiguous()
        if not bool(torch.isfinite(matrix).all()):
            raise AdapterValidationError(f"tensor {name} has non-finite values (checked as {dtype})")
        out[REPLACEABLE.get(key, key)] = matrix
    return out


def replacement_shape(key: str, base: BaseModelShapes) -> tuple[int, ...]:
    """The copy's shape: [vocab, hidden] for lm_head / embed_tokens, the norm's weight otherwise."""
    if key in REPLACEABLE:
        return (base.vocab_size, base.hidden_size)
    return (base.head_dim,) if key.endswith(("q_norm", "k_norm")) else (base.hidden_size,)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
