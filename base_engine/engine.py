"""The engine loop: schedule -> run model -> sample -> postprocess, one step at a time.

Synchronous and single-threaded; `LLM` drives it offline and `AsyncEngine` from a worker thread.
"""

from __future__ import annotations

import bisect
import logging
import time
from functools import cached_property
from pathlib import Path

import torch

from adapters.loader import Fetch
from adapters.types import AdapterRef
from base_engine.block_manager import BlockManager
from base_engine.detokenizer import Detokenizer
from base_engine.engine_config import EngineConfig
from base_engine.invariant import Determinism
from base_engine.logit_rules import check_rule_token_ids
from base_engine.lora import LoraStepBatch, make_lora_manager
from base_engine.model.config import load_model_config
from base_engine.model.decoder import LOGITS_CHUNK
from base_engine.model.int8 import quantize_int8
from base_engine.model.tokenizer import load_tokenizer
from base_engine.model.weights import load_model
from base_engine.model_weights import ModelWeights
from base_engine.outputs import ITERATION_TOKEN_BUCKETS, NON_FINITE, EngineStats, RequestOutput
from base_engine.postprocess import check_stop, finish_output, step_output
from base_engine.priority import PriorityPolicy
from base_engine.prompt_logprobs import record as record_prompt_logprobs
from base_engine.runner.cuda_graphs import DecodeGraphs
from base_engine.runner.device import check_device, resolve_dtype
from base_engine.runner.host import set_intra_op_threads
from base_engine.runner.kv_sizing import plan_memory
from base_engine.runner.model_runner import ModelRunner, allocate_kv_caches
from base_engine.runner.step import StepBatch, StepResult
from base_engine.runner.weight_sizing import check_model_fits
from base_engine.sampler import Sampler
from base_engine.sampling_params import SamplingParams
from base_engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from base_engine.sequence import Sequence, SequenceStatus
from base_engine.speculative.draft_model import DraftModelProposer, draft_dir
from base_engine.speculative.probe import measure_costs
from base_engine.speculative.rows import group_rows, sampling_rows
from base_engine.speculative.speculator import Speculator, parse_speculative
from base_engine.speculative.verify import accepted_tokens

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        config: EngineConfig | None = None,
        fetch: Fetch | None = None,
    ) -> None:
        """`fetch(ref) -> local adapter dir` feeds the adapter cache (the registry's disk tier in the
        server); without it an adapter ref's `source` is taken as a local directory."""
        self.model_dir = Path(model_dir)
        self.model_config = load_model_config(self.model_dir)
        self.config = config or EngineConfig()
        self.device = check_device(device)
        if self.device.type == "cpu":
            set_intra_op_threads(self.config.num_threads)
        self.dtype = resolve_dtype(dtype, self.model_config, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        check_model_fits(self.model_config, self.dtype, self.device)
        model = load_model(self.model_dir, self.model_config, dtype=self.dtype, device=self.device)
        if self.device.type == "cpu" and self.dtype != torch.float32:
            model.keep_float32_logits()
        if self.config.quantization == "int8":
            logger.info("quantization int8: %d linear layers", quantize_int8(model))
        num_blocks = plan_memory(
            self.model_config,
            self.config,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
        )
        kv_caches = allocate_kv_caches(
            self.model_config,
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            dtype=self.dtype,
            device=self.device,
        )
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.lora = make_lora_manager(
            self.model_config.base_shapes(),
            max_loras=self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank,
            max_cpu_loras=self.config.max_cpu_loras,
            max_replacement_bytes=self.config.max_replacement_bytes,
            max_cpu_lora_bytes=self.config.max_cpu_lora_bytes,
            max_wait_s=self.config.max_wait_s,
            dtype=self.dtype,
            device=self.device,
            fetch=fetch,
            base_weights=ModelWeights(model),
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
            policy=self.lora.policy,
            long_factor_after=self.model_config.rope.long_factor_after,
            priority=PriorityPolicy(aging_s=self.config.priority_aging_s),
        )
        self.runner = ModelRunner(
            model,
            self.model_config,
            kv_caches=kv_caches,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            device=self.device,
            attention=self.config.attention,
        )
        self.sampler = Sampler(seed=self.config.seed, eos_token_ids=self.eos_token_ids)
        method = parse_speculative(self.config.speculative)
        self.speculator = (
            None
            if method is None
            else Speculator(
                method, self.config.num_speculative_tokens, self.max_model_len, self._drafter(method)
            )
        )
        if self.speculator is not None:
            self._speculation_costs(self.speculator)
        self.determinism = Determinism(
            model, self.device, self.dtype, always=self.config.deterministic, column_chunk=LOGITS_CHUNK
        )
        # Decode-only steps replay these on CUDA (None: every step runs eagerly). Not on MoE models: the
        # grouped GEMM's segments and the expert LoRA's (adapter, expert) metadata follow each step's routing.
        self.graphs: DecodeGraphs | None = None
        dense = self.model_config.moe is None
        if self.device.type == "cuda" and self.config.enable_cuda_graphs and self.runner.use_paged and dense:
            self.graphs = self.make_decode_graphs(capture=True)
        self.requests: dict[str, Sequence] = {}
        self.detokenizers: dict[str, Detokenizer] = {}
        self.num_steps = 0
        self.iteration_token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # EngineStats'
        self.iteration_tokens_sum = 0
        self.step_request_ids: list[str] = []  # requests of the step in progress (failed if it raises)
        # Outputs of the step in progress, appended as they are made: when a step raises, the finals
        # of the requests it already finished are still here to be delivered.
        self.step_outputs: list[RequestOutput] = []

    def _drafter(self, method: str) -> DraftModelProposer | None:
        path = draft_dir(method)
        if path is None:
            return None
        return DraftModelProposer(path, self.model_config, self.tokenizer, device=self.device)

    def _speculation_costs(self, speculator: Speculator) -> None:
        """Measured at start: the verify cost table (cost-aware k) and its off batch; a configured
        off batch instead: adaptive k alone, off from that batch (0: never)."""
        off = self.config.speculative_off_batch
        if off is None:
            k, max_seqs = self.config.num_speculative_tokens, self.config.max_num_seqs
            speculator.costs = measure_costs(self.runner, k, max_seqs, self.max_model_len)
            speculator.off_batch = speculator.costs.off_batch
        else:
            speculator.off_batch = None if off == 0 else off

    @cached_property
    def base_weight_norms(self) -> dict[tuple[int, str], float]:
        """||W||_F per (layer, checkpoint projection) for uploads' coverage reports: computed on first
        use (an upload's worker thread; weights are read-only), not at start, so a meta-device engine
        (tests/base_engine/test_device_guard.py) and start-up pay nothing."""
        return ModelWeights(self.runner.model).frobenius_norms()

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        max_len = self.config.max_model_len or limit
        if max_len > limit:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings {limit}")
        window = self.model_config.sliding_window
        if self.model_config.model_type == "mistral" and window is not None and window < max_len:
            logger.info(
                "serving %s with sliding window %d < max_model_len %d", self.model_dir, window, max_len
            )
        windows = self.model_config.layer_windows or ()
        if any(w is not None for w in windows):
            logger.info(
                "serving %s with sliding window %d on %d of %d layers (the others attend globally)",
                self.model_dir, max(w for w in windows if w is not None),
                sum(w is not None for w in windows), len(windows),
            )  # fmt: skip
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_len}) when chunked prefill is off, or no long prompt could ever be scheduled"
            )
        return max_len

    def make_decode_graphs(self, *, capture: bool) -> DecodeGraphs:
        """Decode CUDA graphs over the runner and the adapter slot pool (capture=False: eager replay)."""
        return DecodeGraphs(
            self.runner,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            lora_pool=self.lora.cache.pool,
            make_lora_batch=LoraStepBatch,
            capture=capture,
        )

    # ---- requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {self.model_config.vocab_size})")
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the limit; nothing is queued. Safe to call from any thread."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, more than max_model_len {self.max_model_len}"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.deterministic and (reason := self.determinism.refusal()) is not None:
            raise ValueError(reason)
        check_rule_token_ids(params, self.model_config.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        adapter: AdapterRef | None = None,
        tenant_id: str | None = None,
        cache_salt: bytes = b"",
        arrival: float | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, adapter, tenant_id, cache_salt)
        if arrival is not None:
            seq.times.arrival = arrival
        seq.priority = priority
        seq.deterministic = self.determinism.always or params.deterministic
        if seq.deterministic:
            seq.seed = self.determinism.seed(params.seed)
        elif params.seed is not None:
            seq.seed = params.seed
        self.requests[request_id] = seq
        self.detokenizers[request_id] = Detokenizer(self.tokenizer, params, seq.prompt_token_ids)
        self.lora.on_add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request now: its blocks and adapter pin are released before this returns."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, SequenceStatus.FINISHED_ABORTED)

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        seq.error = error
        return self._finish(seq, SequenceStatus.FINISHED_ERROR)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.step_request_ids = []
        outputs: list[RequestOutput] = []
        self.step_outputs = outputs  # the same list: what this step appends is seen if it raises
        outputs.extend(self._fail_unloadable())
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self.step_request_ids = [item.seq.request_id for item in sched.scheduled]
        for seq in sched.overflowed:
            outputs.append(self._overflow(seq))
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        # [1, 8, 16, ...]: a step of 9 tokens counts in the bucket of 16
        self.iteration_token_counts[
            bisect.bisect_left(ITERATION_TOKEN_BUCKETS, sched.num_batched_tokens)
        ] += 1
        self.iteration_tokens_sum += sched.num_batched_tokens
        invariant = self.determinism.always or any(item.seq.deterministic for item in sched.scheduled)
        batch = self._prepare(sched, invariant=invariant)
        self.runner.clear_blocks(self.block_manager.take_fresh_blocks())
        result = self._run_model(batch, invariant=invariant)
        sampled = self._sample(batch, result)
        is_finite = result.is_finite.tolist()  # read with the sampled ids: no extra wait
        for item, ok in zip(batch.order, is_finite, strict=True):
            if not ok:
                outputs.append(self._fail_non_finite(item.seq))
        if batch.prompt is not None and result.prompt is not None:  # before the first token's output
            record_prompt_logprobs(batch.prompt, result.prompt)
        for item in sched.scheduled:
            if item.seq.is_finished or item.drafts:
                continue  # failed above (freed, never published), or verified below
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit_full_blocks(item.seq)
        for item, token_ids, logprobs in sampled:
            if item.seq.is_finished:
                continue
            if item.drafts:
                outputs.extend(self._append_verified(item, token_ids, logprobs))
            else:
                outputs.append(self._append_token(item.seq, token_ids[0], logprobs[0]))
        return outputs

    def _prepare(self, sched: SchedulerOutput, *, invariant: bool) -> StepBatch:
        """A decode-only step a CUDA graph covers fills that graph's buffers; any other (and every
        deterministic step) is flattened by the runner."""
        if self.graphs is not None and not invariant:
            batch = self.graphs.prepare(sched)
            if batch is not None:
                return batch
        return self.runner.prepare(sched, invariant=invariant)

    def _run_model(self, batch: StepBatch, *, invariant: bool) -> StepResult:
        if batch.graph_bucket is not None and self.graphs is not None:
            return self.graphs.replay(batch)  # its LoRA metadata lives in the graph's static buffers
        lora_batch = self.lora.prepare_step(batch.row_slots, invariant=invariant)
        return self.runner.execute(batch, lora_batch)

    def _fail_unloadable(self) -> list[RequestOutput]:
        """Waiting requests whose adapter cannot be loaded end with the loader's error."""
        outputs: list[RequestOutput] = []
        for failure in self.lora.before_step(self.scheduler.waiting):
            out = self.fail(failure.request_id, failure.error)
            if out is not None:
                outputs.append(out)
        return outputs

    def _sample(
        self, batch: StepBatch, result: StepResult
    ) -> list[tuple[ScheduledSeq, list[int], list[dict[int, float] | None]]]:
        """Per sampled request: its tokens and logprobs, one per sampled row (drafts: k + 1 rows)."""
        if not batch.sampled:
            return []
        rows = sampling_rows(batch.sampled)
        sampled = self.sampler(result.logits, rows)
        return group_rows(batch.sampled, sampled.token_ids, sampled.logprobs)

    def _append_verified(
        self, item: ScheduledSeq, token_ids: list[int], logprobs: list[dict[int, float] | None]
    ) -> list[RequestOutput]:
        """A speculated request: its accepted drafts and next token are appended as a decode would
        append them one by one; the rejected drafts' K/V are rolled back (never published)."""
        seq, outputs = item.seq, []
        emitted = accepted_tokens(item.drafts, token_ids)
        seq.draft_token_ids = []
        assert self.speculator is not None
        self.speculator.record(seq, len(item.drafts), len(emitted) - 1)
        for j, token_id in enumerate(emitted):
            outputs.append(self._append_token(seq, token_id, logprobs[j]))
            if seq.is_finished:
                return outputs
        seq.num_computed_tokens = item.start + len(emitted)  # its last token and the accepted drafts
        self.block_manager.trim(seq)
        self.block_manager.commit_full_blocks(seq)
        return outputs

    def _fail_non_finite(self, seq: Sequence) -> RequestOutput:
        """Its values left the serving dtype's range (e.g. an adapter that overflows): the request ends
        with an error; rows of other requests never mix with it, so they go on unchanged."""
        cause = "" if seq.adapter is None else f" with adapter {seq.adapter.name!r}"
        seq.error = (
            f"numerical error: the model produced non-finite values (NaN/Inf) for this request{cause}; "
            f"its output would be meaningless"
        )
        seq.error_kind = NON_FINITE
        logger.warning("request %s failed: non-finite hidden states or logits%s", seq.request_id, cause)
        return self._finish(seq, SequenceStatus.FINISHED_ERROR)

    def _append_token(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None) -> RequestOutput:
        now = time.monotonic()
        if seq.times.first_token is None:
            seq.times.first_token = now
        elif seq.times.last_token is not None:
            seq.times.inter_token.append(now - seq.times.last_token)
        seq.times.last_token = now
        seq.output_token_ids.append(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        detok = self.detokenizers[seq.request_id]
        matched_stop = detok.update([token_id])
        stop = check_stop(seq, token_id, matched_stop, self.eos_token_ids, self.max_model_len)
        if stop is not None:
            seq.stop_reason = stop.reason
            return self._finish(seq, stop.status)
        return step_output(seq, detok, token_id, logprobs)

    def _overflow(self, seq: Sequence) -> RequestOutput:
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if seq.output_token_ids:
            return self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        seq.error = f"request needs more than the whole KV cache ({capacity} tokens); use a shorter prompt"
        return self._finish(seq, SequenceStatus.FINISHED_ERROR)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> RequestOutput:
        self.scheduler.finish(seq, status)
        seq.times.finished = time.monotonic()
        self.lora.on_finish(seq)
        del self.requests[seq.request_id]
        detok = self.detokenizers.pop(seq.request_id)
        return finish_output(seq, detok)

    def close(self) -> None:
        """Release what outlives a step: the adapter loader's threads. The engine's owner calls it
        once it is done with the engine; nothing may step it after."""
        self.lora.close()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_total=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_queries=bm.num_prefix_queries,
            num_prefix_hits=bm.num_prefix_hits,
            num_steps=self.num_steps,
            adapters=self.lora.stats(self.scheduler.running, self.scheduler.waiting),
            iteration_token_counts=tuple(self.iteration_token_counts),
            iteration_tokens_sum=self.iteration_tokens_sum,
            spec_decode={} if self.speculator is None else self.speculator.stats.snapshot(),
            spec_acceptance={} if self.speculator is None else self.speculator.stats.acceptance_by_ref(),
        )
