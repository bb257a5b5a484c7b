"""Multi-LoRA in the engine: per-step adapter slots for the flattened batch, load failures, pins.

The adapter cache (adapters/cache.py) owns residency; this module ties it to requests: a request
holds (pins) its adapter's device slot from admission to finish, and every LoRA-targeted projection
of the step adds each row's own adapter delta with one `kernels.sgmv.add_lora` call per projection,
all sharing one `SgmvMeta` built once per step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from adapters.cache import AdapterCache
from adapters.loader import Fetch
from adapters.slots import SlotPool
from adapters.types import AdapterRef, BaseModelShapes, BaseWeights
from base_engine.lora_experts import ExpertStep, expert_step
from base_engine.lora_heads import HeadGroup, add_lm_head, apply_norm, head_groups, replace_embedding
from base_engine.lora_policy import LoraAdmissionPolicy
from base_engine.outputs import AdapterCacheStats, AdapterRequests
from base_engine.sequence import Sequence
from kernels.moe.routing import Routing
from kernels.sgmv import SgmvMeta, add_lora, build_meta


class LocalFetch:
    """Offline: the ref's source is the adapter directory itself (always a local-disk hit)."""

    def __call__(self, ref: AdapterRef) -> Path:
        return Path(ref.source)

    def local_path(self, ref: AdapterRef) -> Path:
        return Path(ref.source)


local_fetch = LocalFetch()


class AdapterFailure(NamedTuple):
    """A waiting request whose adapter cannot be served: the engine fails it with `error`."""

    request_id: str
    error: str


class LoraStepBatch:
    """`model.LoraBatch` for one step: token -> slot rows and the shared kernel metadata."""

    def __init__(self, pool: SlotPool, token_slots: torch.Tensor, meta: SgmvMeta) -> None:
        self.pool = pool
        self.token_slots = token_slots
        self.meta = meta

    @property
    def meta(self) -> SgmvMeta:
        return self._meta

    @meta.setter
    def meta(self, meta: SgmvMeta) -> None:
        # the step's slots, for DoRA's vectors (a captured CUDA graph rewrites the meta each replay)
        self._meta = meta
        self.step_slots = {a for a, n in zip(meta.seg_slots_host, meta.seg_lens_host, strict=True) if n}

    def add_embedding(self, input_ids: torch.Tensor, x: torch.Tensor, multiplier: float | None) -> None:
        """x[rows of a slot with an embedding LoRA] += scale * A^T[ids] @ B^T (times `multiplier`, the
        model's embedding scale, as PEFT's `Embedding` applies the base layer's `embed_scale`)."""
        embedding = self.pool.embedding
        if not embedding or self.step_slots.isdisjoint(embedding):
            return
        meta = self.meta
        for slot, start, n in zip(meta.seg_slots_host, meta.seg_starts_host, meta.seg_lens_host, strict=True):
            e = embedding.get(slot) if n else None
            if e is None:
                continue
            rows = meta.sorted_rows[start : start + n].long()
            delta = (e.a_t[input_ids[rows]] @ e.b_t) * e.scale  # PEFT: (after_A @ B^T) * scaling
            if multiplier is not None:
                delta = delta * multiplier
            x.index_add_(0, rows, delta.to(x.dtype))

    def add_lm_head(
        self, logits: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor, invariant: bool
    ) -> None:
        add_lm_head(self.pool, self.token_slots, self.step_slots, logits, hidden, rows, invariant)

    def head_groups(self, rows: torch.Tensor) -> list[HeadGroup]:
        return head_groups(self.pool, self.token_slots, self.step_slots, rows)

    def replace_embedding(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        replace_embedding(self.pool, self.meta, self.step_slots, input_ids, x)

    def apply_norm(self, norm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.pool.replacements:
            apply_norm(self.pool, self.meta, self.step_slots, norm, x, y)

    def experts(self, layer: int, routing: Routing) -> ExpertStep | None:
        return expert_step(
            self.pool.experts, self.token_slots, self.step_slots, layer, routing, self.meta.invariant
        )

    def apply(self, layer: int, projection: str, y: torch.Tensor, x: torch.Tensor) -> None:
        slots = self.pool.layers[layer][projection]
        # DoRA's vectors only when a row of this step needs them; always on CUDA, where a captured graph
        # replays the launch with other adapters (plain slots hold 1 and 0 there, one load per tile).
        out_scale = out_shift = None
        if y.device.type != "cpu" or not slots.dora_slots.isdisjoint(self.step_slots):
            out_scale, out_shift = slots.out_scale, slots.out_shift
        if y.device.type == "cpu":
            if slots.covered.isdisjoint(self.step_slots):
                return  # no row of the step has LoRA here (e.g. the router, MLPs of attention-only adapters)
            # Many small matmuls: on a few shared cores, extra OpenMP threads only add barrier waits.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                add_lora(y, x, slots.lora_a, slots.lora_b, self.token_slots, scales=slots.scales,
                         ranks=slots.ranks, meta=self.meta, out_scale=out_scale,
                         out_shift=out_shift)  # fmt: skip
            finally:
                torch.set_num_threads(threads)
            return
        add_lora(y, x, slots.lora_a, slots.lora_b, self.token_slots, scales=slots.scales, ranks=slots.ranks,
                 meta=self.meta, out_scale=out_scale, out_shift=out_shift)  # fmt: skip


class LoraManager:
    def __init__(self, cache: AdapterCache, policy: LoraAdmissionPolicy) -> None:
        self.cache = cache
        self.policy = policy

    @staticmethod
    def local_ref(path: Path) -> AdapterRef:
        """An offline adapter directory as a ref: identity = resolved path + weights hash."""
        path = path.resolve()
        weights = path / "adapter_model.safetensors"
        digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else "missing"
        return AdapterRef(id=str(path), sha256=digest, source=str(path), name=path.name)

    def on_add(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self.cache.request_load(seq.adapter)  # start fetching now, off the step

    def housekeeping(self) -> None:
        """Collect finished background loads and place pinned adapters (also while the engine idles)."""
        self.cache.poll()
        self.cache.place_pinned()

    def before_step(self, waiting: Iterable[Sequence]) -> list[AdapterFailure]:
        """Housekeeping, then the waiting requests whose adapter failed to load (the engine fails them)."""
        self.housekeeping()
        failures: list[AdapterFailure] = []
        for seq in waiting:
            if seq.adapter is None or seq.adapter_slot >= 0:
                continue
            error = self.cache.error(seq.adapter)
            if error is not None:
                failures.append(AdapterFailure(seq.request_id, error))
            elif self.cache.has_failed(seq.adapter):
                self.cache.request_load(seq.adapter)  # the pause after a transient failure is over
        return failures

    def prepare_step(self, row_slots: list[int], *, invariant: bool = False) -> LoraStepBatch | None:
        if all(s < 0 for s in row_slots):
            return None  # a base-only step never touches the LoRA path
        # Built on the host (no device read inside the step), then one copy of each tensor.
        host_slots = torch.tensor(row_slots, dtype=torch.long, device="cpu")
        meta = build_meta(host_slots, self.cache.pool.num_slots, invariant=invariant)
        device = self.cache.device
        if device.type == "cpu":
            return LoraStepBatch(self.cache.pool, host_slots, meta)
        pinned = host_slots.pin_memory() if device.type == "cuda" else host_slots
        token_slots = pinned.to(device, non_blocking=True)
        return LoraStepBatch(self.cache.pool, token_slots, meta.to(device, non_blocking=True))

    def on_finish(self, seq: Sequence) -> None:
        if seq.adapter_slot >= 0:
            self.cache.release(seq.adapter_slot)
            seq.adapter_slot = -1

    def pin(self, ref: AdapterRef) -> None:
        self.cache.forget_failure(ref)
        self.cache.pin(ref)

    def unpin(self, ref: AdapterRef) -> None:
        self.cache.unpin(ref)

    def set_pins(self, wanted: dict[str, AdapterRef]) -> None:
        """Pin exactly `wanted` (ref.id -> ref): unpin every other pinned adapter, pin what is missing."""
        for ref_id, ref in list(self.cache.pinned.items()):
            if ref_id not in wanted:
                self.unpin(ref)
        for ref_id, ref in wanted.items():
            if ref_id not in self.cache.pinned:
                self.pin(ref)

    def prefetch(self, ref: AdapterRef) -> bool:
        """Start loading `ref` (a no-op while it loads or is resident); True once it is resident on
        either tier or its load failed for good."""
        self.cache.request_load(ref)
        cache = self.cache
        return ref.id in cache.host or ref.id in cache.slot_of or ref.id in cache.loader.failed

    def evict(self, ref_ids: list[str]) -> list[str]:
        """Drop these adapters from both tiers; returns those still serving in-flight requests."""
        return [ref_id for ref_id in ref_ids if not self.cache.evict(ref_id)]

    def close(self) -> None:
        self.cache.close()

    def stats(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> AdapterCacheStats:
        s = self.cache.stats
        residency = self.cache.residency()
        return AdapterCacheStats(
            gpu_bytes=sum(self.cache.host_bytes.get(i, 0) for i in self.cache.slot_of),
            gpu_pool_bytes=self.cache.pool.num_bytes,
            cpu_bytes=sum(self.cache.host_bytes.values()),
            num_slots=self.cache.pool.num_slots,
            num_gpu=sum(1 for t in residency.values() if t == "gpu"),
            num_cpu=len(self.cache.host),
            residency=residency,
            pinned=sorted(self.cache.pinned),
            loads=s.num_loads,
            load_seconds=s.load_seconds,
            load_failures=s.num_load_failures,
            hits=s.num_hits,
            misses=s.num_misses,
            evictions=s.num_evictions,
            cpu_evictions=s.num_cpu_evictions,
            per_adapter=_requests_per_adapter(running, waiting),
            ranks=self.cache.ranks(),
            recent_load_seconds=tuple(s.recent_load_s),
            recent_activate_seconds=tuple(s.recent_activate_s),
        )


def _requests_per_adapter(
    running: Iterable[Sequence], waiting: Iterable[Sequence]
) -> dict[str, AdapterRequests]:
    """ref.id -> its running and waiting requests (adapters with none are absent), in first-seen order."""
    counts: dict[str, list[int]] = {}
    for index, seqs in enumerate((running, waiting)):
        for seq in seqs:
            if seq.adapter is not None:
                counts.setdefault(seq.adapter.id, [0, 0])[index] += 1
    return {ref_id: AdapterRequests(running=r, waiting=w) for ref_id, (r, w) in counts.items()}


def make_lora_manager(
    base: BaseModelShapes,
    *,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int,
    max_wait_s: float,
    dtype: torch.dtype,
    device: torch.device,
    fetch: Fetch | None,
    base_weights: BaseWeights | None = None,
    max_replacement_bytes: int | None = None,
    max_cpu_lora_bytes: int | None = None,
) -> LoraManager:
    """The adapter cache over the base model's shapes and its admission policy (given to the scheduler).

    On CUDA the `max_loras` device slots were reserved before the KV cache was sized
    (kv_sizing.plan_memory)."""
    cache = AdapterCache(
        base,
        fetch=fetch or local_fetch,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_cpu_loras=max_cpu_loras,
        dtype=dtype,
        device=device,
        base_weights=base_weights,
        max_replacement_bytes=max_replacement_bytes,
        max_cpu_bytes=max_cpu_lora_bytes,
    )
    return LoraManager(cache, LoraAdmissionPolicy(cache, max_wait_s=max_wait_s))
