"""What the engine hands back: per-request outputs (streamed deltas and final state) and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

# `RequestOutput.error_kind` of a request whose own values left the serving dtype's range (NaN/Inf in
# its hidden states or logits): caused by what it ran (its adapter), not by the engine.
NON_FINITE = "non_finite"


@dataclass(slots=True)
class RequestMetrics:
    queue_time_s: float = 0.0  # arrival -> first scheduled
    prefill_time_s: float = 0.0  # first scheduled -> first token
    ttft_s: float = 0.0  # arrival -> first token
    e2e_s: float = 0.0  # arrival -> finished
    inter_token_s: list[float] = field(default_factory=list)
    priority: int = 0  # its priority class as submitted (lower = more urgent; base_engine/priority.py)


@dataclass(frozen=True, slots=True)
class PromptTokenLogprobs:
    """vLLM's prompt logprobs of one prompt token (base_engine/prompt_logprobs.py)."""

    logprobs: dict[int, float]  # the prompt token's own first, then the top-N alternatives
    rank: int  # 1-based rank of the prompt token in its distribution (1 + the tokens scored higher)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated text so far (cut at a stop string)
    new_token_ids: list[int] = field(default_factory=list)  # produced by the last step
    new_text: str = ""  # text safe to stream since the previous output (never half a UTF-8 char)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it, else None
    logprobs: list[dict[int, float]] | None = None  # per generated token, when asked
    # Per prompt token (the first None), when asked: on the first token's output and the final one.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    error_kind: str | None = None  # NON_FINITE: the request's own values overflowed; None: other causes
    metrics: RequestMetrics | None = None  # set when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class AdapterRequests:
    """In-flight requests of one adapter."""

    running: int = 0
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class AdapterCacheStats:
    """The adapter cache as of one step. Field names are the keys of its JSON view (the admin API's
    `dataclasses.asdict`), so they follow the published names rather than `num_*`."""

    gpu_bytes: int = 0  # host bytes of the adapters in device slots (what they occupy there)
    gpu_pool_bytes: int = 0  # device memory the slot tensors hold, used or not
    cpu_bytes: int = 0  # bytes of every host-tier adapter
    num_slots: int = 0  # device slots (max_loras)
    num_gpu: int = 0  # adapters in a device slot
    num_cpu: int = 0  # adapters in the host tier
    residency: dict[str, str] = field(default_factory=dict)  # ref.id -> "gpu" | "cpu"
    pinned: list[str] = field(default_factory=list)  # operator-pinned ref ids, sorted
    loads: int = 0  # finished background loads
    load_seconds: float = 0.0  # their total duration
    load_failures: int = 0
    hits: int = 0  # activations that found the adapter in a slot
    misses: int = 0  # activations that copied it into a slot
    evictions: int = 0  # adapters dropped from a device slot
    cpu_evictions: int = 0  # adapters dropped from the host tier
    per_adapter: dict[str, AdapterRequests] = field(default_factory=dict)  # ref.id -> its requests
    ranks: dict[str, int] = field(default_factory=dict)  # ref.id -> rank, host-tier adapters
    recent_load_seconds: tuple[float, ...] = ()  # the latest loads' durations, oldest first (<= 256)
    recent_activate_seconds: tuple[float, ...] = ()  # the latest host -> slot copies' durations


@dataclass(frozen=True, slots=True)
class SpecDecodeCounts:
    """Speculative decoding's cumulative counts for one adapter (vLLM's `spec_decode_*` names): requests'
    steps that carried drafts, the draft tokens scored, those accepted, and per draft position the
    drafts whose token there was accepted. Acceptance rate = accepted / draft tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        return None if self.num_draft_tokens == 0 else self.num_accepted_tokens / self.num_draft_tokens


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_hits: int  # of those, tokens found
    num_steps: int
    adapters: AdapterCacheStats = field(default_factory=AdapterCacheStats)
    # Steps by the tokens they computed (vLLM's `iteration_tokens_total`): count per bucket of
    # ITERATION_TOKEN_BUCKETS (upper bounds, inclusive), then the count above the last; and their sum.
    iteration_token_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # Speculative decoding per adapter name as clients send it ("" = the base model); empty when off.
    spec_decode: dict[str, SpecDecodeCounts] = field(default_factory=dict)
    # Acceptance rate (accepted / draft tokens) per adapter version (`AdapterRef.id`; "" = the base
    # model): the admin console's per-adapter figure. Only versions that had drafts verified.
    spec_acceptance: dict[str, float] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / max(1, self.num_kv_blocks_total)
