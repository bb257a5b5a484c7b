"""Embedding and lm_head LoRA at load: the base embedding (or LM head) PEFT saves beside the factors
(its default `save_embedding_layers="auto"` when `embed_tokens` or `lm_head` is targeted) must be the
served model's, since `PeftModel.from_pretrained` loads it over the base; checked here once, against the
base weights, then dropped (it is never kept in the cache). The deltas themselves are applied by the
engine (base_engine/lora.py `LoraStepBatch.add_embedding`, `add_lm_head`)."""

from __future__ import annotations

import dataclasses

from adapters.factors import check_embedding_copy
from adapters.format import LoraAdapter
from adapters.lm_head import check_head_copy
from adapters.peft_targets import EMBEDDING_KEY, LM_HEAD_KEY
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


def without_head_copy(adapter: LoraAdapter, base: BaseWeights | None) -> LoraAdapter:
    """`adapter` with its saved base LM head checked against `base` and dropped."""
    if adapter.lm_head_copy is None:
        return adapter
    if base is None:
        raise AdapterFormatError(
            f"the adapter saves {LM_HEAD_KEY}'s base weight, which needs the base model's weights to "
            "check; this adapter cache was not given them"
        )
    check_head_copy(LM_HEAD_KEY, adapter.lm_head_copy, base.lm_head())
    return dataclasses.replace(adapter, lm_head_copy=None)
