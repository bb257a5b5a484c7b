"""Turns one scheduled step into flat tensors, runs the model and returns the rows to sample.

Rows are grouped by adapter slot (one contiguous run per adapter for the LoRA kernels), decodes
first within a slot: e.g. base decode a, base chunk c (3 tokens), slot-0 decode b, slot-0 chunk d (2)
-> rows [a, c0, c1, c2, b, d0, d1]; decode attention then gathers its queries from rows [0, 4]
(in length buckets, see attention.plan_decode_buckets).
"""

from __future__ import annotations

import torch

from base_engine.model.config import ModelConfig
from base_engine.model.decoder import CausalLM, LoraBatch
from base_engine.model.rope import RopeCache
from base_engine.prompt_logprobs import PromptRows, prompt_positions, score
from base_engine.runner.attention import AttentionMetadata, PrefillChunk, chunk_mask, paged_with_window
from base_engine.runner.decode_buckets import DecodeBucket, build_decode_buckets, build_token_buckets
from base_engine.runner.step import StepBatch, StepResult
from base_engine.scheduler import ScheduledSeq, SchedulerOutput
from base_engine.sequence import Sequence
from kernels.attention import build_paged_meta


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
        attention: str = "auto",
    ) -> None:
        self.model = model
        # kernels.attention on CUDA (or when asked); the bucketed torch path is fastest on CPU.
        self.use_paged = attention == "paged" or (attention == "auto" and device.type == "cuda")
        self.kv_caches = kv_caches
        self.block_size = block_size
        # The pool's two extra blocks belong to no request: the null block stays zero (decode buckets
        # pad with it), the scratch block takes the K/V writes of CUDA-graph padding rows.
        self.null_block = kv_caches[0].shape[1] - 2 if kv_caches else 0
        self.scratch_block = self.null_block + 1
        self.device = device
        # The window of the step's main metadata, and `local_window` for a model that mixes windowed
        # and global layers (Gemma): those read AttentionMetadata.sliding, built with it.
        windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
        self.local_window = max(windows - {None}) if len(windows) > 1 else None
        self.sliding_window = None if self.local_window is not None else windows.pop()
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.rope = RopeCache(
            config.rope, config.head_dim, dtype=dtype, device=device, max_positions=max_model_len
        )
        self.rope(torch.tensor([max_model_len - 1], device=device), max_model_len - 1)  # whole table, once
        # Gemma 3: the windowed layers rotate with their own base frequency.
        self.local_rope = None
        if config.local_rope is not None:
            self.local_rope = RopeCache(config.local_rope, config.head_dim, dtype=dtype, device=device)
            self.local_rope(torch.tensor([max_model_len - 1], device=device), max_model_len - 1)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of step metadata on the engine's device (CUDA: pinned, asynchronous copy)."""
        if self.device.type == "cpu":
            return tensor
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def prepare(self, sched: SchedulerOutput, *, invariant: bool = False) -> StepBatch:
        """invariant: a deterministic step (base_engine/invariant.py): batch-invariant GEMMs, and every
        token attended alone (build_token_buckets)."""
        # Rows grouped by adapter slot, so each adapter's rows form one contiguous run that the LoRA
        # kernels update in place; within a slot, decodes first. Without adapters (all slots -1) this
        # is simply decodes then prefills.
        order = sorted(sched.scheduled, key=lambda s: (s.seq.adapter_slot, not _is_decode(s)))
        decodes = [s for s in order if _is_decode(s)]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_slots: list[int] = []
        seq_of_row: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        sampled_seq: list[int] = []
        row_starts: list[int] = []
        chunks: list[PrefillChunk] = []
        local_chunks: list[PrefillChunk] = []  # the same chunks under local_window's masks
        bs = self.block_size
        decode_rows: list[int] = []
        prompt_rows: list[int] = []  # rows scored for prompt logprobs (position p scores token p + 1)
        prompt_targets: list[int] = []
        prompt_owners: list[Sequence] = []
        for index, item in enumerate(order):
            seq, start, n = item.seq, item.start, item.num_new_tokens
            row = len(input_ids)
            row_starts.append(row)
            input_ids += seq.token_ids(start, start + n - len(item.drafts)) + item.drafts
            table = seq.block_table
            for pos in range(start, start + n):
                slots.append(table[pos // bs] * bs + pos % bs)
            rope_row = start + self.rope.row_offset(seq.is_long_rope)  # LongRoPE: long half of the table
            positions += range(rope_row, rope_row + n)
            row_slots += [seq.adapter_slot] * n
            seq_of_row += [index] * n
            if item.is_sampled:  # with drafts: its last token's row and every draft's
                num_sampled = len(item.drafts) + 1
                sample_rows += range(row + n - num_sampled, row + n)
                sampled += [item] * num_sampled
                sampled_seq += [index] * num_sampled
            positions_scored = prompt_positions(seq, start, n)
            prompt_rows += (row + pos - start for pos in positions_scored)
            prompt_targets += seq.prompt_token_ids[positions_scored.start + 1 : positions_scored.stop + 1]
            prompt_owners += [seq] * len(positions_scored)
            if _is_decode(item):
                decode_rows.append(row)
            elif not self.use_paged and not invariant:
                block_table = self.to_device(
                    torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.long, device="cpu")
                )
                mask = chunk_mask(start, n, self.sliding_window)
                mask = None if mask is None else self.to_device(mask)
                chunks.append(PrefillChunk(row, n, start, block_table, mask))
                if self.local_window is not None:
                    local_mask = self.to_device(chunk_mask(start, n, self.local_window))
                    local_chunks.append(PrefillChunk(row, n, start, block_table, local_mask))
        meta = self._meta(order, decodes, decode_rows, row_starts, chunks, self.sliding_window, invariant)
        if self.local_window is not None and meta.paged is not None:
            meta.sliding = paged_with_window(meta, self.local_window)  # the same device tensors
        elif self.local_window is not None:
            args = (order, decodes, decode_rows, row_starts, local_chunks, self.local_window, invariant)
            meta.sliding = self._meta(*args)
        meta.slot_mapping = self.to_device(torch.tensor(slots, dtype=torch.long, device="cpu"))

        def host(values: list[int]) -> torch.Tensor:
            return self.to_device(torch.tensor(values, dtype=torch.long, device="cpu"))

        return StepBatch(
            order=order,
            input_ids=host(input_ids),
            positions=host(positions),
            max_position=max(positions),
            meta=meta,
            sample_rows=host(sample_rows),
            sampled=sampled,
            row_slots=row_slots,
            seq_of_row=host(seq_of_row),
            sampled_seq=host(sampled_seq),
            prompt=self._prompt_rows(prompt_rows, prompt_targets, prompt_owners),
        )

    def _prompt_rows(self, rows: list[int], targets: list[int], owners: list[Sequence]) -> PromptRows | None:
        if not rows:
            return None
        num_top = max(seq.params.prompt_logprobs or 0 for seq in owners)
        host = torch.tensor([rows, targets], dtype=torch.long, device="cpu")
        on_device = self.to_device(host)
        return PromptRows(rows=on_device[0], targets=on_device[1], owners=owners, num_top=num_top)

    def _meta(
        self,
        order: list[ScheduledSeq],
        decodes: list[ScheduledSeq],
        decode_rows: list[int],
        row_starts: list[int],
        chunks: list[PrefillChunk],
        window: int | None,
        invariant: bool,
    ) -> AttentionMetadata:
        """The step's attention metadata for layers with sliding window `window` (None: full)."""
        if invariant:
            return self._token_meta(order, row_starts, window)
        if self.use_paged:
            return self._paged_meta(order, decodes, decode_rows, row_starts, window)
        meta = self._decode_meta(decodes, decode_rows, window)
        meta.prefills = chunks
        return meta

    def _decode_meta(
        self, decodes: list[ScheduledSeq], rows: list[int], window: int | None
    ) -> AttentionMetadata:
        # Bucketed here, once per step, so every layer reuses the same block tables and masks.
        buckets = build_decode_buckets(
            rows,
            [d.seq.block_table for d in decodes],
            [d.start + 1 for d in decodes],  # the new token's K/V is written before attention reads
            block_size=self.block_size,
            sliding_window=window,
            dtype=self.dtype,
            null_block=self.null_block,
        )
        self._buckets_to_device(buckets)
        return AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long, device="cpu"), decode_buckets=buckets, prefills=[]
        )

    def _buckets_to_device(self, buckets: list[DecodeBucket]) -> None:
        for bucket in buckets:
            bucket.rows = self.to_device(bucket.rows)
            bucket.block_tables = self.to_device(bucket.block_tables)
            bucket.mask = None if bucket.mask is None else self.to_device(bucket.mask)

    def _token_meta(
        self, order: list[ScheduledSeq], starts: list[int], window: int | None
    ) -> AttentionMetadata:
        rows, tables, seq_lens, seq_ids = [], [], [], []
        for index, (item, row) in enumerate(zip(order, starts, strict=True)):
            for i in range(item.num_new_tokens):
                rows.append(row + i)
                tables.append(item.seq.block_table)
                seq_lens.append(item.start + i + 1)  # the token's own K/V is written before attention
                seq_ids.append(index)
        buckets = build_token_buckets(
            rows, tables, seq_lens, seq_ids, block_size=self.block_size, sliding_window=window,
            dtype=self.dtype,
        )  # fmt: skip
        self._buckets_to_device(buckets)
        empty = torch.empty(0, dtype=torch.long, device="cpu")
        return AttentionMetadata(slot_mapping=empty, decode_buckets=buckets, prefills=[], invariant=True)

    def _paged_meta(
        self,
        order: list[ScheduledSeq],
        decodes: list[ScheduledSeq],
        decode_rows: list[int],
        starts: list[int],
        window: int | None,
    ) -> AttentionMetadata:
        chunks = [(item, row) for item, row in zip(order, starts, strict=True) if not _is_decode(item)]
        paged = build_paged_meta(
            block_size=self.block_size,
            device=self.device,
            decode_seq_lens=[d.start + 1 for d in decodes],
            decode_tables=[d.seq.block_table for d in decodes],
            decode_rows=decode_rows,
            prefill_query_starts=[row for _, row in chunks],
            prefill_query_lens=[item.num_new_tokens for item, _ in chunks],
            prefill_seq_lens=[item.start + item.num_new_tokens for item, _ in chunks],
            prefill_tables=[item.seq.block_table for item, _ in chunks],
            sliding_window=window,
            pad_block=self.null_block,
        )
        return AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long, device="cpu"),
            decode_buckets=[],
            prefills=[],
            paged=paged,
        )

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero blocks handed to new owners (whatever the previous owner left, NaN included)."""
        if not block_ids:
            return
        index = self.to_device(torch.tensor(block_ids, dtype=torch.long, device="cpu"))
        for cache in self.kv_caches:
            cache.index_fill_(1, index, 0)

    @torch.inference_mode()
    def execute(self, batch: StepBatch, lora: LoraBatch | None = None) -> StepResult:
        """Runs the model: logits for batch.sampled and which requests stayed finite. No host sync.
        This is also what a decode CUDA graph captures (over its static batch)."""
        cos_sin = self.rope(batch.positions, batch.max_position)
        local = None if self.local_rope is None else self.local_rope(batch.positions, batch.max_position)
        hidden = self.model(batch.input_ids, cos_sin, self.kv_caches, batch.meta, lora, local)
        rows = batch.sample_rows
        logits = self.model.logits(hidden.index_select(0, rows), batch.meta.invariant, lora, rows)
        prompt = None
        if batch.prompt is not None:
            invariant, prompt_rows, done = batch.meta.invariant, batch.prompt.rows, [0]

            def prompt_logits(h: torch.Tensor) -> torch.Tensor:
                # `score` hands the rows over in order, in blocks: each block's step rows, for the
                # adapters' own heads (lm_head LoRA, modules_to_save) as on the sampled rows.
                begin, done[0] = done[0], done[0] + h.shape[0]
                return self.model.logits(h, invariant, lora, prompt_rows[begin : done[0]])

            prompt = score(prompt_logits, hidden.index_select(0, prompt_rows), batch.prompt)
        # A row's own K/V feed its own attention, so a NaN/Inf written to the cache at any layer shows
        # in that row's final hidden state; logits can still overflow on their own. A row sum is NaN/Inf
        # iff a value is (or the finite values' sum overflows fp32, ~1e34 each: broken all the same),
        # and costs a fraction of isfinite(...).all() (one pass, no [rows, vocab] bool tensor).
        num_bad = torch.zeros(batch.num_seqs, dtype=torch.int32, device=hidden.device)
        num_bad.index_add_(0, batch.seq_of_row, (~torch.isfinite(hidden.sum(dim=-1))).to(torch.int32))
        num_bad.index_add_(0, batch.sampled_seq, (~torch.isfinite(logits.sum(dim=-1))).to(torch.int32))
        is_finite = num_bad == 0
        # Rows of failed requests sample from zeros (harmless, discarded). On a GPU without reading the
        # flags back; on the CPU that read is free and spares a pass over the logits.
        if logits.device.type != "cpu" or not bool(is_finite.all()):
            logits.masked_fill_(~is_finite.index_select(0, batch.sampled_seq).unsqueeze(1), 0.0)
        return StepResult(logits, is_finite, prompt)


def allocate_kv_caches(
    config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks + 2, block_size, kv_heads, head_dim] tensor per layer; the two extra blocks are
    the runner's null block (decode padding, stays zero) and scratch block (K/V writes of CUDA-graph
    padding rows), never allocated to a request. On the CPU only those two are zeroed: every other block
    is zeroed when it is handed to an owner (`clear_blocks`), so the pool's pages are committed as
    blocks are first used, not all at start-up (torch.zeros writes every page of a pool of gigabytes)."""
    shape = (2, num_blocks + 2, block_size, config.num_key_value_heads, config.head_dim)
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
    caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
    for cache in caches:
        cache[:, num_blocks:].zero_()
    return caches


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype, device="cpu").element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
    return per_token * block_size


def _is_decode(item: ScheduledSeq) -> bool:
    """One new token with context before it: attended in a decode bucket, not as a prefill chunk."""
    return item.num_new_tokens == 1 and item.start > 0
