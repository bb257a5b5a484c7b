"""Embedding LoRA at load: the base embedding PEFT saves beside the factors (its default
`save_embedding_layers="auto"` when `embed_tokens` is targeted) must be the served model's, since
`PeftModel.from_pretrained` loads it over the base; checked here once, against the base weights, then
dropped (it is never kept in the cache). The delta itself, `scale * B A[:, t]` per token, is applied by
the engine (base_engine/lora.py `LoraStepBatch.add_embedding`)."""

from __future__ import annotations

import dataclasses

from adapters.factors import check_embedding_copy
from adapters.format import LoraAdapter
from adapters.peft_targets import EMBEDDING_KEY
from adapters.types import AdapterFormatError, BaseWeights


def without_embedding_copy(adapter: LoraAdapter, base: BaseWeights | None) -> LoraAdapter:
    """`adapter` with its saved base embedding checked against `base` and dropped."""
    if adapter.embedding_copy is None:
        return adapter
    if base is None:
        raise AdapterFormatError(
            f"the adapter saves {EMBEDDING_KEY}'s base weight, which needs the base model's weights to "
            "check; this adapter cache was not given them"
        )
    check_embedding_copy(EMBEDDING_KEY, adapter.embedding_copy, base.embedding())
    return dataclasses.replace(adapter, embedding_copy=None)
