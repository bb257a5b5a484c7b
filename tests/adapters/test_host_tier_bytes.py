"""The host tier is bounded by bytes as well as by count (adapters/host_tier.py): modules_to_save copies
count as the device tier counts them, so a tier with room for N plain adapters holds fewer with lm_head
copies, and evicts least recently used until the bytes fit; an adapter whose copies alone exceed the host
budget (or whose file exceeds the disk tier's) is refused with the figures, at upload and at load.

Real peft adapters on the tiny Llama, loaded by the cache's own background loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters.cache import AdapterCache, adapter_bytes
from adapters.format import load_adapter
from adapters.host_tier import default_cpu_lora_bytes
from adapters.slots import SlotPool
from adapters.types import AdapterRef, AdapterValidationError
from adapters.validation import validate_adapter
from tests.harness.peft_adapters import save_peft_adapter, tiny_shapes
from tests.harness.wait import wait_for

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HEAD_COPY = 128 * 64 * 4  # the tiny Llama's [vocab, hidden] lm_head in fp32


def loaded(cache: AdapterCache, ref: AdapterRef) -> None:
    cache.request_load(ref)

    def in_host_tier() -> bool:
        assert not cache.poll(), "load failed"
        return ref.id in cache.host

    wait_for(in_host_tier, 30, interval=0.02, what="adapter loaded")


def _ref(directory: Path, i: int) -> AdapterRef:
    return AdapterRef(id=f"t/{directory.name}@1", sha256=f"{i:064x}", source=str(directory))


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[AdapterRef]]:
    root = tmp_path_factory.mktemp("host_tier")
    plain = [save_peft_adapter(root / f"p{i}", r=8, target_modules=ALL, seed=i) for i in range(5)]
    heavy = [save_peft_adapter(root / f"h{i}", r=8, target_modules=ALL, seed=10 + i,
                               modules_to_save=["lm_head"]) for i in range(3)]  # fmt: skip
    return {
        "plain": [_ref(d, i) for i, d in enumerate(plain)],
        "heavy": [_ref(d, 10 + i) for i, d in enumerate(heavy)],
    }


def _cache(max_cpu_bytes: int | None, max_cpu_loras: int = 8) -> AdapterCache:
    return AdapterCache(
        tiny_shapes(), fetch=lambda ref: Path(ref.source), max_loras=2, max_lora_rank=8,
        max_cpu_loras=max_cpu_loras, dtype=torch.float32, device=torch.device("cpu"),
        max_cpu_bytes=max_cpu_bytes,
    )  # fmt: skip


def _sizes(refs: dict[str, list[AdapterRef]]) -> tuple[int, int]:
    plain = adapter_bytes(load_adapter(Path(refs["plain"][0].source), base=tiny_shapes()))
    heavy = adapter_bytes(load_adapter(Path(refs["heavy"][0].source), base=tiny_shapes()))
    assert heavy == plain + HEAD_COPY  # the copy is counted
    return plain, heavy


def test_room_for_four_plain_adapters_holds_two_with_head_copies(refs) -> None:
    plain, heavy = _sizes(refs)
    budget = 4 * plain  # 4 x 65536; 2 heavy = 196608 fit, 3 = 294912 do not
    assert 2 * heavy <= budget < 3 * heavy
    cache = _cache(budget)
    try:
        for ref in refs["plain"][:4]:
            loaded(cache, ref)
        assert set(cache.host) == {r.id for r in refs["plain"][:4]} and cache.stats.num_cpu_evictions == 0
        loaded(cache, refs["plain"][4])  # a fifth: the least recently used gives way
        assert refs["plain"][0].id not in cache.host and len(cache.host) == 4
        assert sum(cache.host_bytes.values()) == 4 * plain

        loaded(cache, refs["heavy"][0])  # 65536 + 32768 more: two plain ones (LRU) give way, not one
        assert list(cache.host) == [r.id for r in refs["plain"][3:5]] + [refs["heavy"][0].id]
        for ref in refs["heavy"][1:]:
            loaded(cache, ref)
        assert list(cache.host) == [r.id for r in refs["heavy"][1:]]  # two heavy ones at most
        assert sum(cache.host_bytes.values()) == 2 * heavy <= budget
        assert cache.stats.num_cpu_evictions == 6
    finally:
        cache.close()


def test_count_still_bounds_the_tier(refs) -> None:
    cache = _cache(1 << 30, max_cpu_loras=2)
    try:
        for ref in refs["heavy"]:
            loaded(cache, ref)
        assert list(cache.host) == [r.id for r in refs["heavy"][1:]]
    finally:
        cache.close()


def test_default_budget_is_the_plain_adapters_plus_one_adapters_copies() -> None:
    base = tiny_shapes()
    cache = _cache(None)
    try:
        per_slot = SlotPool.bytes_per_slot(base, 8, torch.float32)
        assert cache.max_cpu_bytes == 8 * per_slot + (2 << 30)
        assert cache.max_cpu_bytes == default_cpu_lora_bytes(
            base, max_cpu_loras=8, max_lora_rank=8, dtype=torch.float32, max_replacement_bytes=2 << 30
        )
    finally:
        cache.close()


def test_copies_above_the_host_budget_are_refused_with_the_figures(refs) -> None:
    directory, base = Path(refs["heavy"][0].source), tiny_shapes()
    limits = {"base": base, "max_lora_rank": 8, "max_size_bytes": 1 << 26}
    with pytest.raises(
        AdapterValidationError,
        match=rf"copies need {HEAD_COPY} bytes of host memory \(lm_head \[128, 64\] torch.float32\), "
        rf"above the host tier's budget of {HEAD_COPY - 1} bytes; raise max_cpu_lora_bytes "
        r"\(LORASERVE_MAX_CPU_LORA_BYTES\)",
    ):
        validate_adapter(directory, **limits, host_tier_bytes=HEAD_COPY - 1)
    validate_adapter(directory, **limits, host_tier_bytes=HEAD_COPY)
    size = (directory / "adapter_model.safetensors").stat().st_size
    with pytest.raises(
        AdapterValidationError,
        match=rf"needs {size} bytes on the local disk tier, above its budget of {size - 1} bytes; raise "
        r"disk_cache_bytes \(LORASERVE_DISK_CACHE_BYTES\)",
    ):
        validate_adapter(directory, **limits, disk_tier_bytes=size - 1)
    validate_adapter(directory, **limits, disk_tier_bytes=size)


def test_a_cache_refuses_to_load_copies_above_its_host_budget(refs) -> None:
    cache = _cache(HEAD_COPY - 1)
    try:
        ref = refs["heavy"][0]
        cache.request_load(ref)
        failures: list[tuple[str, str]] = []
        wait_for(lambda: bool(failures.extend(cache.poll()) or failures), 30, interval=0.02, what="refusal")
        assert failures[0][0] == ref.id and "above the host tier's budget" in failures[0][1]
        assert ref.id not in cache.host
    finally:
        cache.close()
