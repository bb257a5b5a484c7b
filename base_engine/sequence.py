"""One request's state inside the engine; the scheduler and engine loop are the only writers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from adapters.types import AdapterRef
from base_engine.outputs import PromptTokenLogprobs
from base_engine.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered: everything >= FINISHED_STOPPED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(slots=True)
class SequenceTimes:
    """Wall-clock stamps (time.monotonic) for the per-request latency statistics."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token: list[float] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    tenant_id: str | None = None
    cache_salt: bytes = b""  # per-tenant secret mixed into prefix-cache keys (cross-tenant isolation)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Prompt tokens 1.. scored so far, when params.prompt_logprobs is set (base_engine/prompt_logprobs.py)
    prompt_logprobs: list[PromptTokenLogprobs] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of this sequence's full blocks
    seed: int | None = None  # counter-based sampling seed (base_engine/seeded_uniform.py); None: shared
    stop_reason: str | int | None = None  # RequestOutput.stop_reason, set when it finishes
    error: str | None = None
    error_kind: str | None = None  # RequestOutput.error_kind
    times: SequenceTimes = field(default_factory=SequenceTimes)
    adapter_slot: int = -1  # device slot of its adapter while running (-1 = base model)
    deterministic: bool = False  # runs only in batch-invariant steps (base_engine/invariant.py)
    is_long_rope: bool = False  # its K/V use LongRoPE's long factors (set by the scheduler)
    priority: int = 0  # lower = more urgent (vLLM's convention); base_engine/priority.py
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (speculative/)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the concatenation."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]
