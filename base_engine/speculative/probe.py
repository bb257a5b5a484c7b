"""The verify cost table, measured on this device at engine start (cost.py uses it per step).

At batch b, a decode step computes b tokens and a verify step of k drafts b * (k + 1). While decode is
bound by reading the weights the verify costs little more; once it is compute-bound it costs about
k + 1 decodes and drafts no longer pay. The probe times one step of b requests with n new tokens each,
t(b, n) for n = 1 .. K + 1, on the engine's own runner (fake requests whose K/V all go to the pool's
scratch block, which belongs to no request) at b = 1, 2, 4, ... up to max_num_seqs, and stops at the
first b where no k pays even at acceptance BREAK_EVEN_ALPHA: that b is the table's off_batch (no
drafts in a step with that many decodes).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from base_engine.runner.model_runner import ModelRunner
from base_engine.sampling_params import SamplingParams
from base_engine.scheduler import ScheduledSeq, SchedulerOutput
from base_engine.sequence import Sequence
from base_engine.speculative.cost import BREAK_EVEN_ALPHA, CostTable, pays_at

logger = logging.getLogger(__name__)

CONTEXT = 128  # tokens before the decoded one (a typical chat context)
REPEATS = 5  # the fastest of these per timing (after one warm-up)


def cost_table(row_seconds: Callable[[int], tuple[float, ...]], max_num_seqs: int) -> CostTable:
    """t(b, n) = row_seconds(b)[n - 1] (n = 1 .. K + 1, made non-decreasing in n) for b = 1, 2, 4, ...
    (<= max_num_seqs), up to the first b where no k pays at BREAK_EVEN_ALPHA (the table's off_batch)."""
    seconds: dict[int, tuple[float, ...]] = {}
    b = 1
    while b <= max_num_seqs:
        # More new tokens are never cheaper: a dip is timing noise (a loaded host), kept out of the
        # table as the dearer neighbour (t(b, n) >= t(b, n - 1)).
        row = seconds[b] = tuple(itertools.accumulate(row_seconds(b), max))
        logger.debug("speculation probe: batch %d, verify / decode = %s", b, [t / row[0] for t in row])
        if not pays_at(row, BREAK_EVEN_ALPHA):
            return CostTable(seconds, off_batch=b)
        b *= 2
    return CostTable(seconds)


def measure_costs(runner: ModelRunner, k: int, max_num_seqs: int, max_model_len: int) -> CostTable:
    context = max(1, min(CONTEXT, max_model_len - k - 1))

    def row_seconds(batch: int) -> tuple[float, ...]:
        """The fastest of REPEATS per n, the n interleaved in each repeat so load drift (other
        processes on a shared host) hits every n of the row alike."""
        steps = [_fake_step(runner, batch, n, context) for n in range(1, k + 2)]
        best = [float("inf")] * len(steps)
        for i in range(REPEATS + 1):
            for n, sched in enumerate(steps):
                start = time.perf_counter()
                result = runner.execute(runner.prepare(sched), None)
                result.is_finite.tolist()  # waits for the device
                if i > 0:
                    best[n] = min(best[n], time.perf_counter() - start)
        return tuple(best)

    with torch.inference_mode():
        table = cost_table(row_seconds, max_num_seqs)
    relative = {b: [round(t / row[0], 2) for t in row] for b, row in table.seconds.items()}
    logger.info("speculation cost table (verify / decode, k=%d): %s; off from batch %s", k, relative,
                table.off_batch)  # fmt: skip
    return table


def _fake_step(runner: ModelRunner, batch: int, num_new: int, context: int) -> SchedulerOutput:
    """`batch` base-model requests of `context` computed tokens, each with num_new - 1 drafts."""
    bs = runner.block_size
    table = [runner.scratch_block] * -(-(context + num_new) // bs)
    out = SchedulerOutput()
    for i in range(batch):
        seq = Sequence(f"probe-{i}", [0] * (context + 1), SamplingParams(max_tokens=num_new))
        seq.block_table = table
        seq.num_computed_tokens = context
        out.scheduled.append(ScheduledSeq(seq, num_new, context, [0] * (num_new - 1)))
        out.num_batched_tokens += num_new
    return out
