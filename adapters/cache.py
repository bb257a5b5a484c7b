"""Bounded two-tier adapter cache: device slots (what the kernels read) over a host-memory tier.

Tiers: device slots (`max_loras`, fixed tensors, see slots.py) <- host tier (at most `max_cpu_loras`
parsed adapters and `max_cpu_bytes` of them, modules_to_save copies counted; host_tier.py) <-
`fetch(ref) -> local dir` (the registry's disk tier in the server, the path offline).
Loading (fetch, parse, validate, convert) runs in the background (loader.py: small pools, deadlines,
retries with backoff); the engine thread only copies a host-tier adapter into a free slot. The cache
owns the slot tensors and the pins and decides which slots may be evicted (no in-flight request
holds them, the operator has not pinned them); an eviction policy (eviction.py, LRU by default)
picks the victim among those (S-LoRA's unified cache, without paging: slots are fixed-size).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapters.dora import with_dora_scales
from adapters.embedding import without_embedding_copy, without_head_copy
from adapters.eviction import EvictionPolicy, LruEviction
from adapters.format import LoraAdapter, LoraPair, load_adapter
from adapters.host_tier import check_tier_budgets, default_cpu_lora_bytes
from adapters.loader import AdapterLoader, Fetch, PendingLoad
from adapters.replacements import DEFAULT_MAX_REPLACEMENT_BYTES
from adapters.slots import SlotPool
from adapters.types import AdapterRef, BaseModelShapes, BaseWeights

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CacheStats:
    num_loads: int = 0
    load_seconds: float = 0.0
    num_load_failures: int = 0
    num_hits: int = 0  # activations that found the adapter already in a slot
    num_misses: int = 0  # activations that had to copy it into a slot
    num_evictions: int = 0  # adapters dropped from a slot to make room
    num_cpu_evictions: int = 0
    # The latest durations, for the load-time histogram (the metrics side reads those it has not seen,
    # by the totals `num_loads` / `num_misses`): background loads and host -> slot copies.
    recent_load_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_DURATIONS))
    recent_activate_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_DURATIONS))


RECENT_DURATIONS = 256


@dataclass(slots=True)
class _Slot:
    ref: AdapterRef | None = None
    num_requests: int = 0  # in-flight requests pinning it


class AdapterCache:
    def __init__(
        self,
        base: BaseModelShapes,
        *,
        fetch: Fetch,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
        eviction: EvictionPolicy | None = None,
        base_weights: BaseWeights | None = None,
        max_replacement_bytes: int | None = DEFAULT_MAX_REPLACEMENT_BYTES,
        max_cpu_bytes: int | None = None,
    ) -> None:
        self.base = base
        self.max_replacement_bytes = max_replacement_bytes  # per adapter, its modules_to_save matrices
        self.base_weights = base_weights  # for DoRA's norms, computed at load (adapters/dora.py)
        self.fetch = fetch
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        if max_cpu_bytes is None:
            max_cpu_bytes = default_cpu_lora_bytes(
                base, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank, dtype=dtype,
                max_replacement_bytes=max_replacement_bytes,
            )  # fmt: skip
        self.max_cpu_bytes = max_cpu_bytes  # host tier bytes (adapter_bytes summed)
        self.dtype = dtype
        self.device = device
        self.pool = SlotPool(base, num_slots=max_loras, max_rank=max_lora_rank, dtype=dtype, device=device)
        self.slots = [_Slot() for _ in range(max_loras)]
        self.eviction = eviction or LruEviction()
        self.slot_of: dict[str, int] = {}  # ref.id -> device slot
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # ref.id -> parsed adapter, LRU order
        self.host_bytes: dict[str, int] = {}  # ref.id -> bytes of its factors, computed once at load
        self.pinned: dict[str, AdapterRef] = {}  # operator pins, by ref.id
        self.stats = CacheStats()
        self.loader = AdapterLoader(fetch, self._parse)

    def _parse(self, path: Path) -> LoraAdapter:
        """Parse and check one adapter directory, then precompute DoRA's scales (loader threads)."""
        adapter = load_adapter(
            path, base=self.base, dtype=self.dtype, max_lora_rank=self.max_lora_rank,
            max_replacement_bytes=self.max_replacement_bytes,
        )  # fmt: skip
        adapter = without_head_copy(without_embedding_copy(adapter, self.base_weights), self.base_weights)
        check_tier_budgets(adapter, 0, host_bytes=self.max_cpu_bytes, disk_bytes=None)
        return with_dora_scales(adapter, self.base_weights)

    @property
    def pending(self) -> dict[str, PendingLoad]:
        return self.loader.pending

    # ---- where an adapter is ------------------------------------------------------------------

    def residency(self) -> dict[str, str]:
        """ref.id -> "gpu" (in a device slot; "gpu" also on CPU-only hosts) or "cpu" (host tier)."""
        out = {ref_id: "cpu" for ref_id in self.host}
        out.update({ref_id: "gpu" for ref_id in self.slot_of})
        return out

    def ranks(self) -> dict[str, int]:
        """ref.id -> the adapter's rank (its largest over modules), for every host-tier adapter."""
        return {ref_id: adapter.max_rank for ref_id, adapter in self.host.items()}

    def error(self, ref: AdapterRef) -> str | None:
        """Why `ref` cannot be served now, or None (loaded, loading, or a failure whose pause is over:
        `has_failed` tells that case, and `request_load` tries again)."""
        return self.loader.error(ref)

    def has_failed(self, ref: AdapterRef) -> bool:
        """The last load of `ref` failed (transient or not) and no load has started since."""
        return ref.id in self.loader.failed

    def retry_after_s(self, ref: AdapterRef) -> float | None:
        """After a transient load failure: seconds until the next try (what a 503 tells clients)."""
        return self.loader.retry_after_s(ref)

    # ---- background loading -------------------------------------------------------------------

    def request_load(self, ref: AdapterRef) -> None:
        """Start loading into the host tier unless resident, loading or refused. Never blocks."""
        if ref.id in self.host or ref.id in self.slot_of:
            return
        self.loader.start(ref)

    def poll(self) -> list[tuple[str, str]]:
        """Moves finished loads into the host tier; returns (ref id, error) for loads that failed."""
        done, failures = self.loader.poll()
        self.stats.num_load_failures += len(failures)
        for ref_id, adapter, seconds in done:
            if self.device.type == "cuda":
                adapter = _pin_host_memory(adapter)
            self.stats.num_loads += 1
            self.stats.load_seconds += seconds
            self.stats.recent_load_s.append(seconds)
            self.host[ref_id] = adapter
            self.host_bytes[ref_id] = adapter_bytes(adapter)
            self._trim_host(keep=ref_id)
        return failures

    def forget_failure(self, ref: AdapterRef) -> None:
        self.loader.forget(ref)

    def close(self) -> None:
        """Stop the loader's threads (loads in flight are cancelled); the cache loads nothing after."""
        self.loader.shutdown()

    def _host_over(self) -> bool:
        return len(self.host) > self.max_cpu_loras or sum(self.host_bytes.values()) > self.max_cpu_bytes

    def _trim_host(self, keep: str | None = None) -> None:
        """Evict host copies LRU down to max_cpu_loras and max_cpu_bytes. Adapters in a device slot
        stay (they are its source) and `keep`, the adapter that just landed, stays: a waiting request
        wants it. When only slot holders are left, an idle slot (no request, not pinned) gives way, LRU;
        otherwise, with every slot holding an idle adapter and max_cpu_loras == max_loras, a new adapter
        was dropped as soon as it landed and reloaded forever while its request waited."""
        while self._host_over():
            victim = next(
                (r for r in self.host if r not in self.slot_of and r not in self.pinned and r != keep), None
            )
            if victim is None:
                victim = self._free_idle_slot()
            if victim is None:
                return  # every other copy is in use: over the bound until a request ends
            del self.host[victim]
            del self.host_bytes[victim]
            self.stats.num_cpu_evictions += 1

    def _free_idle_slot(self) -> str | None:
        """Empties the idle, unpinned slot the eviction policy picks; the id it held, or None."""
        slot = self.eviction.victim(self._evictable_slots())
        if slot is None:
            return None
        return self._evict_slot(slot)

    def _evictable_slots(self) -> list[int]:
        """Occupied slots no in-flight request holds and the operator has not pinned, in slot order."""
        return [i for i, s in enumerate(self.slots) if s.ref is not None and self._is_evictable(s)]

    def _evict_slot(self, slot: int) -> str:
        """Empties an occupied slot; the id it held."""
        ref = self.slots[slot].ref
        assert ref is not None
        del self.slot_of[ref.id]
        self.slots[slot] = _Slot()
        self.stats.num_evictions += 1
        return ref.id

    # ---- device slots -------------------------------------------------------------------------

    def can_acquire(self, ref: AdapterRef) -> bool:
        """`acquire(ref)` would give a slot now: it holds one, or it is in the host tier and a slot is
        empty or evictable."""
        if ref.id in self.slot_of:
            return True
        if ref.id not in self.host:
            return False
        return any(s.ref is None for s in self.slots) or bool(self._evictable_slots())

    def acquire(self, ref: AdapterRef) -> int | None:
        """Slot for one new in-flight request of `ref`, copying it in if needed; None = not now."""
        slot = self.slot_of.get(ref.id)
        if slot is None:
            if ref.id not in self.host:
                self.request_load(ref)
                return None
            slot = self._free_slot()
            if slot is None:
                return None
            started = time.perf_counter()
            self.pool.write(slot, self.host[ref.id])
            self.stats.recent_activate_s.append(time.perf_counter() - started)
            self.slots[slot].ref = ref
            self.slot_of[ref.id] = slot
            self.stats.num_misses += 1
        else:
            self.stats.num_hits += 1
        self.host.move_to_end(ref.id)
        self.slots[slot].num_requests += 1
        self.eviction.touch(slot)
        return slot

    def release(self, slot: int) -> None:
        """One in-flight request of the adapter in `slot` ended."""
        state = self.slots[slot]
        if state.num_requests <= 0:
            raise RuntimeError(f"adapter slot {slot} released more often than acquired")
        state.num_requests -= 1
        self.eviction.touch(slot)

    def _is_evictable(self, state: _Slot) -> bool:
        return state.ref is None or (state.num_requests == 0 and state.ref.id not in self.pinned)

    def _free_slot(self) -> int | None:
        """An empty slot (the first), else the one the eviction policy empties; None: all are held."""
        empty = next((i for i, s in enumerate(self.slots) if s.ref is None), None)
        if empty is not None:
            return empty
        slot = self.eviction.victim(self._evictable_slots())
        if slot is not None:
            self._evict_slot(slot)
        return slot

    # ---- operator pins ------------------------------------------------------------------------

    def pin(self, ref: AdapterRef) -> None:
        """Keep `ref` resident: loaded now and never evicted until unpinned."""
        self.pinned[ref.id] = ref
        self.request_load(ref)
        self.place_pinned()

    def unpin(self, ref: AdapterRef) -> None:
        self.pinned.pop(ref.id, None)

    def evict(self, ref_id: str) -> bool:
        """Forget `ref_id` here (its pin, host copy and idle slot): it may no longer be served (deleted,
        its tenant suspended). A slot that in-flight requests still use is kept until they end, then
        reused as any other; returns False then. A load still running lands in the host tier as usual."""
        self.pinned.pop(ref_id, None)
        slot = self.slot_of.get(ref_id)
        if slot is not None:
            if self.slots[slot].num_requests > 0:
                return False
            del self.slot_of[ref_id]
            self.slots[slot] = _Slot()
        self.host.pop(ref_id, None)
        self.host_bytes.pop(ref_id, None)
        return True

    def place_pinned(self) -> None:
        """Move pinned adapters that reached the host tier into device slots while slots are free."""
        for ref_id, ref in self.pinned.items():
            if ref_id in self.host and ref_id not in self.slot_of:
                slot = self.acquire(ref)
                if slot is None:
                    return
                self.release(slot)

    def num_in_flight(self) -> int:
        return sum(s.num_requests for s in self.slots)


def adapter_bytes(adapter: LoraAdapter) -> int:
    """Host bytes of the factors, of DoRA's vectors (magnitude, out_scale, out_shift) and of the
    embedding and lm_head LoRA's factors, of its expert factors (E per MoE tensor) and of its
    modules_to_save matrices."""
    pairs = [*adapter.weights.values(), *(p for p in (adapter.embedding, adapter.lm_head) if p is not None)]
    pairs += adapter.experts.values()
    replaced = sum(t.numel() * t.element_size() for t in adapter.replacements.values())
    return replaced + sum(
        t.numel() * t.element_size()
        for p in pairs
        for t in (p.a, p.b, p.magnitude, p.out_scale, p.out_shift)
        if t is not None
    )


def _pin_host_memory(adapter: LoraAdapter) -> LoraAdapter:
    def pin(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.pin_memory()

    weights = {
        k: LoraPair(
            p.a.pin_memory(), p.b.pin_memory(), p.scale, pin(p.magnitude), pin(p.out_scale), pin(p.out_shift)
        )
        for k, p in adapter.weights.items()
    }
    embedding, lm_head = (
        None if p is None else LoraPair(p.a.pin_memory(), p.b.pin_memory(), p.scale)
        for p in (adapter.embedding, adapter.lm_head)
    )
    replacements = {name: t.pin_memory() for name, t in adapter.replacements.items()}
    experts = {k: LoraPair(p.a.pin_memory(), p.b.pin_memory(), p.scale) for k, p in adapter.experts.items()}
    return dataclasses.replace(
        adapter, weights=weights, embedding=embedding, lm_head=lm_head, replacements=replacements,
        experts=experts,
    )  # fmt: skip
