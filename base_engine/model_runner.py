"""Turns one scheduled step into flat tensors, runs the model and returns the rows to sample.

Rows are grouped by adapter slot (one contiguous run per adapter for the LoRA kernels), decodes
first within a slot: e.g. base decode a, base chunk c (3 tokens), slot-0 decode b, slot-0 chunk d (2)
-> rows [a, c0, c1, c2, b, d0, d1]; decode attention then gathers its queries from rows [0, 4]
(in length buckets, see attention.plan_decode_buckets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from base_engine.attention import AttentionMetadata, PrefillChunk, build_decode_buckets, chunk_mask
from base_engine.config import ModelConfig
from base_engine.model import CausalLM, LoraBatch
from base_engine.rope import RopeCache
from base_engine.scheduler import ScheduledSeq, SchedulerOutput


@dataclass(slots=True)
class StepBatch:
    """One step's flattened inputs."""

    order: list[ScheduledSeq]  # row-block order: decodes then prefills
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] rows whose logits are sampled
    sampled: list[ScheduledSeq]  # the requests those rows belong to, same order
    row_slots: list[int]  # adapter slot of every row (-1 = base model), for the LoRA metadata
    row_starts: list[int]  # first row of each request of `order`; its rows end where the next begins


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [num_sampled, vocab] fp32, rows of batch.sampled
    non_finite: list[ScheduledSeq]  # requests whose hidden states or logits hold NaN/Inf this step


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        *,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        # The last block of the pool belongs to no request and stays zero: decode buckets pad with it.
        self.null_block = kv_caches[0].shape[1] - 1 if kv_caches else 0
        self.device = device
        self.sliding_window = config.sliding_window
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.rope = RopeCache(config.rope, config.head_dim, dtype=dtype, device=device)
        self.rope(torch.tensor([max_model_len - 1]))  # build the whole table once, up front

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        # Rows grouped by adapter slot, so each adapter's rows form one contiguous run that the LoRA
        # kernels update in place; within a slot, decodes first. Without adapters (all slots -1) this
        # is simply decodes then prefills.
        order = sorted(sched.scheduled, key=lambda s: (s.seq.adapter_slot, not _is_decode(s)))
        decodes = [s for s in order if _is_decode(s)]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        chunks: list[PrefillChunk] = []
        row_starts: list[int] = []
        bs = self.block_size
        decode_rows: list[int] = []
        for item in order:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            row = len(input_ids)
            row_starts.append(row)
            input_ids += seq.token_ids(start, start + n)
            table = seq.block_table
            for pos in range(start, start + n):
                slots.append(table[pos // bs] * bs + pos % bs)
            positions += range(start, start + n)
            row_slots += [seq.adapter_slot] * n
            if item.is_sampled:
                sample_rows.append(row + n - 1)
                sampled.append(item)
            if _is_decode(item):
                decode_rows.append(row)
            else:
                block_table = torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.long)
                chunks.append(
                    PrefillChunk(row, n, start, block_table, chunk_mask(start, n, self.sliding_window))
                )
        meta = self._decode_meta(decodes, decode_rows)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
        meta.prefills = chunks
        return StepBatch(
            order=order,
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
            sampled=sampled,
            row_slots=row_slots,
            row_starts=row_starts,
        )

    def _decode_meta(self, decodes: list[ScheduledSeq], rows: list[int]) -> AttentionMetadata:
        # Bucketed here, once per step, so every layer reuses the same block tables and masks.
        buckets = build_decode_buckets(
            rows,
            [d.seq.block_table for d in decodes],
            [d.start + 1 for d in decodes],  # the new token's K/V is written before attention reads
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            dtype=self.dtype,
            null_block=self.null_block,
        )
        return AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long), decode_buckets=buckets, prefills=[]
        )

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero blocks handed to new owners (whatever the previous owner left, NaN included)."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            cache.index_fill_(1, index, 0)

    def execute(self, batch: StepBatch, lora: LoraBatch | None = None) -> StepResult:
        """Runs the model; logits for batch.sampled and the requests that went non-finite."""
        cos_sin = self.rope(batch.positions)
        hidden = self.model(batch.input_ids, cos_sin, self.kv_caches, batch.meta, lora)
        logits = self.model.logits(hidden.index_select(0, batch.sample_rows))
        return StepResult(logits, self._non_finite(batch, hidden, logits))

    def _non_finite(self, batch: StepBatch, hidden: torch.Tensor, logits: torch.Tensor) -> list[ScheduledSeq]:
        # A row's own K/V feed its own attention, so a NaN/Inf written to the cache at any layer shows
        # in that row's final hidden state; logits can still overflow on their own. One host sync in
        # the common case (everything finite).
        row_ok = torch.isfinite(hidden).all(dim=-1)  # [T]
        sample_ok = torch.isfinite(logits).all(dim=-1)  # [num_sampled]
        if bool(row_ok.all()) and bool(sample_ok.all()):
            return []
        bad_rows = set((~row_ok).nonzero().flatten().tolist())
        bad_rows |= {int(batch.sample_rows[i]) for i in (~sample_ok).nonzero().flatten().tolist()}
        ends = batch.row_starts[1:] + [len(batch.input_ids)]
        return [
            item
            for item, start, end in zip(batch.order, batch.row_starts, ends, strict=True)
            if any(start <= r < end for r in bad_rows)
        ]


def allocate_kv_caches(
    config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks + 1, block_size, kv_heads, head_dim] tensor per layer, zeroed (lazily by the OS);
    the extra last block is the runner's null block (decode padding), never allocated to a request."""
    shape = (2, num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
    return per_token * block_size


def _is_decode(item: ScheduledSeq) -> bool:
    """One new token with context before it: attended in a decode bucket, not as a prefill chunk."""
    return item.num_new_tokens == 1 and item.start > 0
