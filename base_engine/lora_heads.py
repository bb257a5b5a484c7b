"""The per-row LM head and embedding of a multi-LoRA step: lm_head LoRA deltas on the logits, and
`modules_to_save` copies of lm_head / embed_tokens / norms read by the rows of their adapter only.

`head_groups` splits the sampled rows into per-adapter groups (the rows of every slot whose adapter has
its own lm_head, then the rest): the model computes each group's logits with that group's matrix
(vocabulary-chunked on CPU), so a step's base rows never pay for a co-batched adapter's head. The
embedding copy is read per slot segment of the step, like the embedding LoRA's gather."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from adapters.slots import SlotPool
from base_engine.invariant import invariant_linear
from kernels.sgmv import SgmvMeta


def apply_norm(
    pool: SlotPool, meta: SgmvMeta, step_slots: set[int], norm: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> None:
    """y[rows of a slot whose adapter saves its own copy of `norm`] = that copy applied to x[rows]: the
    module's own forward with the copy's weight (PEFT's ModulesToSaveWrapper runs the copied module)."""
    key = getattr(norm, "peft_key", None)
    owners = {s for s in step_slots if key in pool.replacements.get(s, {})}
    if not owners:
        return
    for slot, start, n in zip(meta.seg_slots_host, meta.seg_starts_host, meta.seg_lens_host, strict=True):
        if not n or slot not in owners:
            continue
        rows = meta.sorted_rows[start : start + n].long()
        weight = pool.replacements[slot][key]
        y.index_copy_(0, rows, functional_call(norm, {"weight": weight}, (x.index_select(0, rows),)))


class HeadGroup(NamedTuple):
    rows: torch.Tensor  # indices into the sampled rows
    weight: torch.Tensor | None  # [vocab, hidden] of the group's adapter; None: the base head


def _picked(slots: torch.Tensor, slot: int, device: torch.device) -> torch.Tensor:
    return torch.nonzero(slots == slot).flatten().to(device)


def add_lm_head(
    pool: SlotPool, token_slots: torch.Tensor, step_slots: set[int], logits: torch.Tensor,
    hidden: torch.Tensor, rows: torch.Tensor, invariant: bool,
) -> None:  # fmt: skip
    """logits[i] += scale * B (A hidden[i]) for every i whose step row `rows[i]` has a slot with an
    lm_head LoRA (PEFT: `lora_B(lora_A(x)) * scaling` added to the head's output), one pair of
    matmuls per such slot, before any soft-cap and before the sampler's masks."""
    heads = pool.lm_head
    if not heads or step_slots.isdisjoint(heads):
        return
    slots = token_slots.index_select(0, rows.to(token_slots.device))
    linear = invariant_linear if invariant else F.linear
    for slot in sorted(step_slots.intersection(heads)):
        picked = _picked(slots, slot, logits.device)
        if picked.numel() == 0:
            continue
        head = heads[slot]
        h = hidden.index_select(0, picked)
        delta = linear(linear(h, head.a.to(h.dtype)), head.b.to(h.dtype)) * head.scale
        logits.index_add_(0, picked, delta.to(logits.dtype))


def head_groups(
    pool: SlotPool, token_slots: torch.Tensor, step_slots: set[int], rows: torch.Tensor
) -> list[HeadGroup]:
    """[] when no sampled row's adapter has its own lm_head; else one group per such slot and one
    (weight None) for the remaining rows, when there are any."""
    owners = sorted(s for s in step_slots if "lm_head" in pool.replacements.get(s, {}))
    if not owners:
        return []
    slots = token_slots.index_select(0, rows.to(token_slots.device))
    groups, mine = [], torch.zeros_like(slots, dtype=torch.bool)
    for slot in owners:
        hit = slots == slot
        if bool(hit.any()):
            mine |= hit
            groups.append(HeadGroup(_picked(slots, slot, rows.device), pool.replacements[slot]["lm_head"]))
    if not bool(mine.all()):
        groups.append(HeadGroup(torch.nonzero(~mine).flatten().to(rows.device), None))
    return groups


def replace_embedding(
    pool: SlotPool, meta: SgmvMeta, step_slots: set[int], input_ids: torch.Tensor, x: torch.Tensor
) -> None:
    """x[rows of a slot whose adapter has its own embed_tokens] = that matrix's rows for their ids (before
    Gemma's embedding scale, which PEFT's copy of the scaled embedding applies too)."""
    owners = {s for s in step_slots if "embed_tokens" in pool.replacements.get(s, {})}
    if not owners:
        return
    for slot, start, n in zip(meta.seg_slots_host, meta.seg_starts_host, meta.seg_lens_host, strict=True):
        if not n or slot not in owners:
            continue
        rows = meta.sorted_rows[start : start + n].long()
        table = pool.replacements[slot]["embed_tokens"]
        x.index_copy_(0, rows, table[input_ids[rows]].to(x.dtype))
