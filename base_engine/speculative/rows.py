"""Sampling rows of a step whose requests may carry drafts, and their results grouped per request.

A request with k drafts appears k + 1 times in ``StepBatch.sampled`` (consecutive rows); its j-th
row is sampled as the decode after ``output + drafts[:j]`` would be, so penalties, logit rules and
the seeded position (prompt + output length) all see that prefix.
"""

from __future__ import annotations

from typing import TypeVar

from base_engine.sampler import SamplingRow
from base_engine.scheduler import ScheduledSeq

T = TypeVar("T")


def sampling_rows(sampled: list[ScheduledSeq]) -> list[SamplingRow]:
    rows: list[SamplingRow] = []
    j = 0
    for i, item in enumerate(sampled):
        j = j + 1 if i > 0 and sampled[i - 1] is item else 0
        seq = item.seq
        output = seq.output_token_ids if j == 0 else seq.output_token_ids + item.drafts[:j]
        rows.append(SamplingRow(seq.params, seq.prompt_token_ids, output, seq.seed))
    return rows


def group_rows(
    sampled: list[ScheduledSeq], token_ids: list[int], logprobs: list[T]
) -> list[tuple[ScheduledSeq, list[int], list[T]]]:
    """Consecutive rows of one request -> (request, its tokens, its logprobs)."""
    groups: list[tuple[ScheduledSeq, list[int], list[T]]] = []
    for i, item in enumerate(sampled):
        if i > 0 and sampled[i - 1] is item:
            groups[-1][1].append(token_ids[i])
            groups[-1][2].append(logprobs[i])
        else:
            groups.append((item, [token_ids[i]], [logprobs[i]]))
    return groups
