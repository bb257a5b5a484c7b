"""The batch size from which speculation is switched off, measured on this device at engine start.

At batch b, a decode step computes b tokens and a verify step b * (k + 1). While decode is bound by
reading the weights the verify costs little more; once it is compute-bound the verify costs about
k + 1 decodes and drafts no longer pay. The probe times both on the engine's own runner (fake requests
whose K/V all go to the pool's scratch block, which belongs to no request) at b = 1, 2, 4, ... up to
max_num_seqs and returns the first b where verify / decode >= (k + 1) / 2: there a step with drafts
must keep more than half of them to break even. None: not reached within max_num_seqs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from base_engine.runner.model_runner import ModelRunner
from base_engine.sampling_params import SamplingParams
from base_engine.scheduler import ScheduledSeq, SchedulerOutput
from base_engine.sequence import Sequence

logger = logging.getLogger(__name__)

CONTEXT = 128  # tokens before the decoded one (a typical chat context)
REPEATS = 3  # the fastest of these per timing (after one warm-up)


def off_batch_threshold(step_seconds: Callable[[int, int], float], k: int, max_num_seqs: int) -> int | None:
    """The first b in 1, 2, 4, ... (<= max_num_seqs) where step_seconds(b, k + 1) / step_seconds(b, 1)
    >= (k + 1) / 2; step_seconds(b, n): one step of b requests with n new tokens each."""
    b = 1
    while b <= max_num_seqs:
        ratio = step_seconds(b, k + 1) / step_seconds(b, 1)
        logger.debug("speculation probe: batch %d, verify / decode = %.2f", b, ratio)
        if ratio >= (k + 1) / 2:
            return b
        b *= 2
    return None


def measure_off_batch(runner: ModelRunner, k: int, max_num_seqs: int, max_model_len: int) -> int | None:
    context = max(1, min(CONTEXT, max_model_len - k - 1))

    def step_seconds(batch: int, num_new: int) -> float:
        sched = _fake_step(runner, batch, num_new, context)
        best = float("inf")
        for i in range(REPEATS + 1):
            start = time.perf_counter()
            result = runner.execute(runner.prepare(sched), None)
            result.is_finite.tolist()  # waits for the device
            if i > 0:
                best = min(best, time.perf_counter() - start)
        return best

    with torch.inference_mode():
        threshold = off_batch_threshold(step_seconds, k, max_num_seqs)
    logger.info("speculation switches off from batch %s (measured at start, k=%d)", threshold, k)
    return threshold


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
