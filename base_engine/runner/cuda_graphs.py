"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's piecewise-free
"full decode graph"; prefill chunks and mixed steps run eagerly).

A decode-only step of n requests runs in the smallest bucket B >= n. Everything the graph reads lives
in static buffers allocated once per bucket and rewritten in place before each replay:
  input_ids / positions / slot_mapping [B]; paged attention metadata (`build_paged_meta` with
  pad_decodes_to=B, a fixed table width and split count, refreshed with one copy); the LoRA metadata
  (`kernels.sgmv.static_meta.StaticMeta`: a fixed grid, so another set and number of adapters than at
  capture replays correctly).
Padding rows (n..B-1) read nothing (seq_len 0), write their K/V to the runner's scratch block, use no
adapter, and their outputs are dropped. Running example, buckets [1, 2, 4, 8], a step with 3 decodes:
bucket 4, rows [d0, d1, d2, pad], slot_mapping[3] = scratch block * block_size.

`capture=False` runs the same static-buffer path eagerly (CPU tests: the buffers, padding and
replay-with-other-adapters logic, without a GPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from base_engine.runner.attention import AttentionMetadata, paged_with_window
from base_engine.runner.step import StepBatch, StepResult
from base_engine.scheduler import SchedulerOutput
from kernels.attention import PagedAttentionMeta, build_paged_meta
from kernels.sgmv.static_meta import StaticMeta

if TYPE_CHECKING:
    from adapters.slots import SlotPool
    from base_engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (included): e.g. 40 -> [1, 2, 4, 8, 16, 32, 40]."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass(slots=True)
class _Bucket:
    size: int
    batch: StepBatch  # static tensors the graph reads
    paged: PagedAttentionMeta
    lora_meta: StaticMeta | None
    lora: object | None  # a LoraStepBatch over lora_meta's buffers
    graph: torch.cuda.CUDAGraph | None = None
    result: StepResult | None = None  # the graph's output tensors


class DecodeGraphs:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_num_seqs: int,
        max_model_len: int,
        lora_pool: SlotPool | None,
        make_lora_batch,  # (pool, token_slots, meta) -> LoraBatch
        capture: bool,
    ) -> None:
        if not runner.use_paged:
            raise ValueError(
                "CUDA graphs need the paged attention kernels (attention='paged' or 'auto' on CUDA)"
            )
        self.runner = runner
        self.device = runner.device
        self.table_width = -(-max_model_len // runner.block_size)
        self.max_model_len = max_model_len
        self.lora_pool = lora_pool
        self.is_captured = capture
        self.buckets = [self._bucket(size, make_lora_batch) for size in bucket_sizes(max_num_seqs)]
        if capture:
            self._capture_all()

    def _num_splits(self, size: int) -> int:
        if self.device.type != "cuda":
            return 1
        from kernels.attention import triton_ops

        num_kv_heads = self.runner.kv_caches[0].shape[3]
        return triton_ops.default_num_splits(size, num_kv_heads, self.device, self.max_model_len)

    def _paged(self, size: int, lens: list[int], tables: list[list[int]], *, device) -> PagedAttentionMeta:
        return build_paged_meta(
            block_size=self.runner.block_size, device=device, decode_seq_lens=lens, decode_tables=tables,
            sliding_window=self.runner.sliding_window, pad_decodes_to=size,
            decode_table_width=self.table_width, num_splits=self._num_splits(size),
            pad_block=self.runner.null_block, pin_memory=self.device.type == "cuda",
        )  # fmt: skip

    def _bucket(self, size: int, make_lora_batch) -> _Bucket:
        dev = self.device
        rows = torch.arange(size, dtype=torch.long, device=dev)
        paged = self._paged(size, [], [], device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(size, dtype=torch.long, device=dev), decode_buckets=[], prefills=[],
            paged=paged,
        )  # fmt: skip
        if self.runner.local_window is not None:
            meta.sliding = paged_with_window(meta, self.runner.local_window)
        batch = StepBatch(
            order=[], input_ids=torch.zeros(size, dtype=torch.long, device=dev),
            positions=torch.zeros(size, dtype=torch.long, device=dev), max_position=self.max_model_len - 1,
            meta=meta, sample_rows=rows, sampled=[], row_slots=[-1] * size, seq_of_row=rows, sampled_seq=rows,
            graph_bucket=size,
        )  # fmt: skip
        lora_meta = lora = None
        if self.lora_pool is not None:
            num_slots = self.lora_pool.num_slots
            lora_meta = StaticMeta(size, max_segments=min(size, num_slots), num_slots=num_slots, device=dev)
            token_slots = torch.full((size,), -1, dtype=torch.long, device=dev)
            lora = make_lora_batch(
                self.lora_pool, token_slots, lora_meta.update(torch.full((size,), -1, device="cpu"))
            )
        return _Bucket(size, batch, paged, lora_meta, lora)

    def prepare(self, sched: SchedulerOutput) -> StepBatch | None:
        """Fill the smallest fitting bucket's buffers for a decode-only step; None: run eagerly."""
        items = sched.scheduled
        if not items or any(s.num_new_tokens != 1 or s.start == 0 for s in items):
            return None  # a prefill chunk in the step
        bucket = next((b for b in self.buckets if b.size >= len(items)), None)
        if bucket is None:
            return None
        order = sorted(items, key=lambda s: s.seq.adapter_slot)
        slots = [s.seq.adapter_slot for s in order]
        if bucket.lora_meta is None and any(s >= 0 for s in slots):
            return None
        if self.lora_pool is not None and any(s in self.lora_pool.embedding for s in slots):
            return None  # an embedding LoRA's gather runs per slot on the host's segments: eager
        if self.lora_pool is not None and any(s in self.lora_pool.lm_head for s in slots):
            return None  # an lm_head LoRA picks its rows per slot (a host read): eager
        if self.lora_pool is not None and any(s in self.lora_pool.replacements for s in slots):
            return None  # modules_to_save: rows grouped per adapter's own head / embedding: eager
        if bucket.lora_meta is not None and len({s for s in slots if s >= 0}) > bucket.lora_meta.max_segments:
            return None
        self._fill(bucket, order, slots)
        batch = bucket.batch
        batch.order, batch.sampled, batch.row_slots = order, order, slots
        return batch

    def _fill(self, bucket: _Bucket, order, slots: list[int]) -> None:
        bs, pad = self.runner.block_size, bucket.size - len(order)
        positions = [s.start for s in order]
        rope_rows = [s.start + self.runner.rope.row_offset(s.seq.is_long_rope) for s in order]
        ids = [s.seq.token_ids(s.start, s.start + 1)[0] for s in order]
        slot_mapping = [
            s.seq.block_table[p // bs] * bs + p % bs for s, p in zip(order, positions, strict=True)
        ]
        slot_mapping += [self.runner.scratch_block * bs] * pad  # padding rows write to the scratch block
        batch = bucket.batch
        for buffer, values in (
            (batch.input_ids, ids + [0] * pad),
            (batch.positions, rope_rows + [0] * pad),
            (batch.meta.slot_mapping, slot_mapping),
        ):
            buffer.copy_(self._host(values), non_blocking=True)
        lens = [p + 1 for p in positions]
        fresh = self._paged(bucket.size, lens, [s.seq.block_table for s in order], device="cpu")
        bucket.paged.copy_(fresh)
        if bucket.lora_meta is not None:
            host_slots = torch.tensor(slots + [-1] * pad, dtype=torch.long, device="cpu")
            # Same buffers (what a graph reads); the new host view serves the eager CPU twin.
            bucket.lora.meta = bucket.lora_meta.update(host_slots)
            bucket.lora.token_slots.copy_(self._host(host_slots.tolist()), non_blocking=True)

    def _host(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long, device="cpu")
        return host.pin_memory() if self.device.type == "cuda" else host

    @torch.inference_mode()
    def replay(self, batch: StepBatch) -> StepResult:
        bucket = next(b for b in self.buckets if b.size == batch.graph_bucket)
        n = len(batch.order)
        if bucket.graph is None:  # not captured (CPU, tests): the same buffers, run eagerly
            result = self.runner.execute(bucket.batch, bucket.lora)
        else:
            bucket.graph.replay()
            result = bucket.result
        return StepResult(result.logits[:n], result.is_finite[:n])

    def _capture_all(self) -> None:
        """Capture the largest bucket first so smaller ones reuse its memory pool (vLLM's order)."""
        pool = None
        for bucket in sorted(self.buckets, key=lambda b: -b.size):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    self.runner.execute(bucket.batch, bucket.lora)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                bucket.result = self.runner.execute(bucket.batch, bucket.lora)
            bucket.graph = graph
            pool = graph.pool()
        logger.info("captured CUDA graphs for decode batch sizes %s", [b.size for b in self.buckets])
