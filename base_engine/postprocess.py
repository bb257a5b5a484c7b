"""After a token is sampled: when does a request stop, and what does its output look like."""

from __future__ import annotations

from typing import NamedTuple

from base_engine.detokenizer import Detokenizer
from base_engine.outputs import PromptTokenLogprobs, RequestMetrics, RequestOutput
from base_engine.sequence import Sequence, SequenceStatus


class Stop(NamedTuple):
    status: SequenceStatus  # a finished status
    reason: str | int | None = None  # vLLM's `stop_reason`: the stop string or stop token id; None for EOS


def check_stop(
    seq: Sequence, token_id: int, matched_stop: str | None, eos_token_ids: frozenset[int], max_model_len: int
) -> Stop | None:
    """Whether `token_id` ends the request, and what ended it (checked in vLLM's order: EOS before the
    request's stop token ids, so an EOS id also listed in `stop_token_ids` reports None)."""
    params = seq.params
    if matched_stop is not None:
        return Stop(SequenceStatus.FINISHED_STOPPED, matched_stop)
    if seq.num_output_tokens < params.min_tokens:  # as vLLM: no EOS / stop token ends it before min_tokens
        return Stop(SequenceStatus.FINISHED_LENGTH) if seq.num_tokens >= max_model_len else None
    if token_id in eos_token_ids and not params.ignore_eos:
        return Stop(SequenceStatus.FINISHED_STOPPED)
    if token_id in params.stop_token_set:
        return Stop(SequenceStatus.FINISHED_STOPPED, token_id)
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return Stop(SequenceStatus.FINISHED_LENGTH)
    return None


def step_output(
    seq: Sequence, detok: Detokenizer, token_id: int, logprobs: dict[int, float] | None
) -> RequestOutput:
    """A streaming delta; token_ids/text refer to the live state (not copied, to keep steps O(batch))."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=seq.output_token_ids,
        text="",
        new_token_ids=[token_id],
        new_text=detok.take_delta(),
        new_logprobs=[logprobs] if logprobs is not None else [],
        num_cached_tokens=seq.num_cached_tokens,
        prompt_logprobs=_prompt_logprobs(seq) if seq.num_output_tokens == 1 else None,
    )


def _prompt_logprobs(seq: Sequence) -> list[PromptTokenLogprobs | None] | None:
    """vLLM's layout: one entry per prompt token, the first None (it has no distribution)."""
    return None if seq.params.prompt_logprobs is None else [None, *seq.prompt_logprobs]


def finish_output(seq: Sequence, detok: Detokenizer) -> RequestOutput:
    times = seq.times
    first_token = times.first_token if times.first_token is not None else times.finished
    scheduled = times.first_scheduled if times.first_scheduled is not None else times.finished
    assert first_token is not None and scheduled is not None and times.finished is not None
    metrics = RequestMetrics(
        queue_time_s=scheduled - times.arrival,
        prefill_time_s=max(0.0, first_token - scheduled),
        ttft_s=first_token - times.arrival,
        e2e_s=times.finished - times.arrival,
        inter_token_s=list(times.inter_token),
        priority=seq.priority,
    )
    new_text = detok.take_delta(is_final=True)  # first: it completes `text` with any trailing bytes
    new_token_ids = seq.output_token_ids[-1:] if seq.status != SequenceStatus.FINISHED_ABORTED else []
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=detok.text,
        new_token_ids=new_token_ids,
        new_text=new_text,
        new_logprobs=seq.output_logprobs[-1:] if new_token_ids and seq.output_logprobs else [],
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        prompt_logprobs=_prompt_logprobs(seq),
        num_cached_tokens=seq.num_cached_tokens,
        error=seq.error,
        error_kind=seq.error_kind,
        metrics=metrics,
    )
