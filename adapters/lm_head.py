"""lm_head LoRA at parse time: PEFT's LoRA `Linear` on `lm_head` saves `lora_A` [r, hidden] and `lora_B`
[vocab, r]; the engine adds `scale * B (A h)` to each row's logits before the sampler (base_engine/lora.py
`LoraStepBatch.add_lm_head`). A `lora_B` for another vocabulary is refused by name (added tokens need their
own tokenizer). PEFT counts `lm_head` among the embedding layers, so its default `save_embedding_layers=
"auto"` also saves the base head (`lm_head.base_layer.weight`; on a tied model, the input embedding): it
must be the served one (checked at load, adapters/embedding.py, then dropped)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from adapters.factors import _PREFIX, flush_subnormals
from adapters.types import AdapterFormatError, AdapterValidationError, BaseModelShapes


def check_weight_tying(config: dict[str, Any], names: Iterable[str]) -> None:
    """Refuse PEFT's `ensure_weight_tying` with lm_head tensors: PEFT then ties the head's LoRA to the
    embedding's (its config lists only `embed_tokens`), which the engine does not reproduce."""
    if not config.get("ensure_weight_tying"):
        return
    head = next((n for n in names if n.startswith(f"{_PREFIX}lm_head.")), None)
    if head is not None:
        raise AdapterFormatError(
            f"ensure_weight_tying=true with tensor {head!r}: a LoRA tied between embed_tokens and lm_head "
            "is not supported; expected ensure_weight_tying false (LoRA on lm_head and embed_tokens each "
            "on its own is served)"
        )


def checked_lm_head(
    key: str, pair: dict[str, torch.Tensor], r: int, base: BaseModelShapes, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, hidden], B [vocab, r]) of an lm_head LoRA as `dtype`: present, shaped for the base model
    and finite."""
    names = {w: f"{_PREFIX}{key}.lora_{w}.weight" for w in "AB"}
    if "A" not in pair or "B" not in pair:
        missing = [names[w] for w in "AB" if w not in pair]
        raise AdapterFormatError(f"adapter_config.json targets {key!r} but tensors {missing} are missing")
    b = pair["B"]
    if b.ndim == 2 and b.shape[1] == r and b.shape[0] != base.vocab_size:
        raise AdapterFormatError(
            f"tensor {names['B']} covers a vocabulary of {b.shape[0]} tokens, expected the base model's "
            f"{base.vocab_size}: an adapter that adds or removes tokens needs its own tokenizer, which is "
            "not supported"
        )
    expected = {"A": (r, base.hidden_size), "B": (base.vocab_size, r)}
    factors = []
    for which in "AB":
        tensor = pair[which]
        if tuple(tensor.shape) != expected[which]:
            raise AdapterFormatError(
                f"tensor {names[which]} has shape {tuple(tensor.shape)}, expected {expected[which]} "
                f"(r={r}, base hidden={base.hidden_size}, vocab={base.vocab_size})"
            )
        factor = tensor.to(dtype).contiguous()
        if not bool(torch.isfinite(factor).all()):
            raise AdapterValidationError(f"tensor {names[which]} has non-finite values (checked as {dtype})")
        factors.append(flush_subnormals(factor))
    return factors[0], factors[1]


def checked_head_copy(key: str, pair: dict[str, torch.Tensor], base: BaseModelShapes) -> torch.Tensor | None:
    """The saved copy of the base LM head (`lm_head.base_layer.weight`), shape-checked."""
    copy = pair.get("W")
    if copy is None:
        return None
    expected = (base.vocab_size, base.hidden_size)
    if tuple(copy.shape) != expected:
        raise AdapterFormatError(
            f"tensor {_PREFIX}{key}.base_layer.weight has shape {tuple(copy.shape)}, expected {expected} "
            "(the base model's vocab x hidden): a resized LM head needs its own tokenizer, which is not "
            "supported"
        )
    return copy


def check_head_copy(key: str, copy: torch.Tensor, served: torch.Tensor) -> None:
    """Refuse a saved LM head that differs from the served one (PEFT loads it over the base: a trained
    head, not a LoRA), compared in the served dtype."""
    served = served.detach().to("cpu")
    differs = copy.to(served.dtype) != served
    if bool(differs.any()):
        rows = torch.nonzero(differs.any(dim=1)).flatten()
        raise AdapterFormatError(
            f"tensor {_PREFIX}{key}.base_layer.weight differs from the served model's LM head in "
            f"{rows.numel()} rows (first {rows[:4].tolist()}): a trained head is not LoRA; expected the "
            "base weights, or save the adapter with save_embedding_layers=False (or use modules_to_save)"
        )
