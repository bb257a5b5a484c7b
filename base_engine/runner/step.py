"""One step's flattened batch (what the runner and the decode CUDA graphs fill) and its result."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from base_engine.prompt_logprobs import PromptRows, PromptScores
from base_engine.runner.attention import AttentionMetadata
from base_engine.scheduler import ScheduledSeq


@dataclass(slots=True)
class StepBatch:
    """One step's flattened inputs: built on the host, tensors copied to the device once."""

    order: list[ScheduledSeq]  # row-block order: decodes then prefills
    input_ids: torch.Tensor  # [T] on the device
    positions: torch.Tensor  # [T] on the device: RoPE table rows (position + RopeCache.row_offset)
    max_position: int  # max(positions), known on the host
    meta: AttentionMetadata  # tensors on the device
    sample_rows: torch.Tensor  # [num_sampled] rows whose logits are sampled, on the device
    sampled: list[ScheduledSeq]  # the requests those rows belong to, same order (drafts: repeated)
    row_slots: list[int]  # adapter slot of every row (-1 = base model), for the LoRA metadata
    seq_of_row: torch.Tensor  # [T] int64 on the device: index into `order` of each row's request
    sampled_seq: torch.Tensor  # [num_sampled] int64 on the device: index into `order`
    graph_bucket: int | None = None  # decode-only step held in this CUDA graph's static buffers
    prompt: PromptRows | None = None  # rows scored for prompt logprobs (never in a graph's decode step)

    @property
    def num_seqs(self) -> int:
        """Requests the step computes (a graph bucket's padding rows count: its shapes are fixed)."""
        return self.graph_bucket if self.graph_bucket is not None else len(self.order)


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [num_sampled, vocab] fp32, rows of batch.sampled (zeros where not finite)
    is_finite: torch.Tensor  # [len(order)] bool on the device: no NaN/Inf in the request's rows
    prompt: PromptScores | None = None  # of batch.prompt's rows
