"""AdapterCache.evict (a fleet replica drops an adapter that may no longer be served).

Real peft adapters on the tiny Llama, loaded by the cache's own background loader; the oracle is the
cache's residency, pins and slots.
"""

from __future__ import annotations

from pathlib import Path

import torch

from adapters.cache import AdapterCache
from adapters.types import AdapterRef
from tests.harness.peft_adapters import save_peft_adapter, tiny_shapes
from tests.harness.wait import wait_for


def loaded(cache: AdapterCache, ref: AdapterRef, timeout_s: float = 30.0) -> None:
    cache.request_load(ref)

    def in_host_tier() -> bool:
        assert not cache.poll(), "load failed"
        return ref.id in cache.host

    wait_for(in_host_tier, timeout_s, interval=0.02, what="adapter loaded")


def adapters_and_cache(
    tmp_path: Path, *, num: int, max_cpu_loras: int
) -> tuple[list[AdapterRef], AdapterCache]:
    """`num` peft adapters on disk and a cache of two device slots over them."""
    refs = []
    for i in range(num):
        directory = save_peft_adapter(tmp_path / f"a{i}", r=4, target_modules=["q_proj"], seed=i)
        refs.append(AdapterRef(id=f"t/a{i}@1", sha256=f"{i:064x}", source=str(directory)))
    cache = AdapterCache(
        tiny_shapes(),
        fetch=lambda ref: Path(ref.source),
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=max_cpu_loras,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return refs, cache


def test_evict_drops_pin_host_copy_and_idle_slot_but_not_a_busy_one(tmp_path: Path) -> None:
    refs, cache = adapters_and_cache(tmp_path, num=2, max_cpu_loras=4)
    try:
        busy, idle = refs
        for ref in refs:
            loaded(cache, ref)
        cache.pin(idle)
        slot = cache.acquire(busy)  # one in-flight request on `busy`
        assert slot is not None and cache.residency() == {busy.id: "gpu", idle.id: "gpu"}

        assert cache.evict(idle.id) is True
        assert idle.id not in cache.residency() and idle.id not in cache.pinned
        assert cache.evict(busy.id) is False  # its request still reads the slot
        assert cache.residency() == {busy.id: "gpu"}
        cache.release(slot)
        assert cache.evict(busy.id) is True and cache.residency() == {}
        assert all(s.ref is None for s in cache.slots) and cache.evict("never/loaded@1") is True
    finally:
        cache.loader.shutdown()


def test_a_new_adapter_lands_when_every_slot_holds_an_idle_one(tmp_path: Path) -> None:
    """max_cpu_loras == max_loras, both slots holding idle adapters: a third adapter used to be dropped
    from the host tier the moment it landed (the only copy not in a slot) and reloaded forever."""
    refs, cache = adapters_and_cache(tmp_path, num=3, max_cpu_loras=2)
    try:
        for ref in refs[:2]:
            loaded(cache, ref)
            cache.release(cache.acquire(ref))  # a finished request: the slot stays, idle
        loaded(cache, refs[2])
        slot = cache.acquire(refs[2])
        assert slot is not None and cache.residency()[refs[2].id] == "gpu"
        assert len(cache.host) <= 2 and cache.stats.num_loads == 3
        cache.acquire(refs[0])  # the other idle slot takes a reloaded copy; nothing busy was touched
        assert cache.slot_of[refs[2].id] == slot and cache.slots[slot].num_requests == 1
    finally:
        cache.loader.shutdown()
