"""vLLM's `prompt_logprobs`: per prompt token, its logprob, its rank and the top-N alternatives, under
the model's distribution given the tokens before it (`log_softmax` of the raw logits, as the sampler's
logprobs). Prompt token 0 has no distribution: it reads None, as in vLLM.

The logits of position p score prompt token p + 1, so a prefill chunk over positions [start, start+n)
yields entries for tokens start+1 .. start+n (the last prompt position is the sampled row, which
scores the first output token instead). Every position must run: a request that asks for prompt
logprobs skips the prefix cache (base_engine/block_manager.py: `match_prefix`), as vLLM does, and a
preempted one recomputes its prompt without recording the positions it already has.

Rows are scored a block at a time so that a long chunk never holds [chunk, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from base_engine.outputs import PromptTokenLogprobs
from base_engine.sequence import Sequence

ROWS_PER_BLOCK = 256  # [256, 150k] fp32 logits: 150 MB at a time


@dataclass(slots=True)
class PromptRows:
    """A step's prompt-logprob rows, in row order (built by the runner's `prepare`)."""

    rows: torch.Tensor  # [R] rows of the step's hidden states, on the device
    targets: torch.Tensor  # [R] the prompt token each row scores, on the device
    owners: list[Sequence]  # [R] the request of each row
    num_top: int  # the largest N among the owners


@dataclass(slots=True)
class PromptScores:
    """What the model computed for the rows; read on the host by `record`. All [R, ...] on the device."""

    target_logprobs: torch.Tensor  # [R] fp32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, num_top]
    top_logprobs: torch.Tensor  # [R, num_top] fp32


def prompt_positions(seq: Sequence, start: int, num_new: int) -> range:
    """Positions of this chunk whose logits score a prompt token the request has not recorded yet."""
    if seq.params.prompt_logprobs is None:
        return range(0)
    first = max(start, len(seq.prompt_logprobs))  # recorded ones (a preempted request recomputes)
    return range(first, min(start + num_new, seq.num_prompt_tokens - 1))


def score(
    logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, prompt: PromptRows
) -> PromptScores:
    """`hidden`: [R, hidden] the rows' final hidden states; `logits`: [n, hidden] -> [n, vocab] fp32."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for begin in range(0, hidden.shape[0], ROWS_PER_BLOCK):
        block = torch.log_softmax(logits(hidden[begin : begin + ROWS_PER_BLOCK]), dim=-1)  # [b, vocab]
        target = prompt.targets[begin : begin + ROWS_PER_BLOCK].unsqueeze(1)
        own = block.gather(1, target)  # [b, 1]
        rank = (block > own).sum(dim=1) + 1
        top = block.topk(min(prompt.num_top, block.shape[1]), dim=-1)
        parts.append((own.squeeze(1), rank, top.indices, top.values))
    return PromptScores(*(torch.cat(column) for column in zip(*parts, strict=True)))


def record(prompt: PromptRows, scores: PromptScores) -> None:
    """Appends each row's entry to its request (finished ones, e.g. failed this step, are skipped)."""
    own = scores.target_logprobs.tolist()
    ranks = scores.ranks.tolist()
    top_ids, top_lps = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    targets = prompt.targets.tolist()
    for i, seq in enumerate(prompt.owners):
        if seq.is_finished:
            continue
        num_top = seq.params.prompt_logprobs or 0
        entries = {targets[i]: own[i]}
        for token_id, logprob in zip(top_ids[i][:num_top], top_lps[i][:num_top], strict=True):
            entries.setdefault(token_id, logprob)
        seq.prompt_logprobs.append(PromptTokenLogprobs(entries, ranks[i]))
