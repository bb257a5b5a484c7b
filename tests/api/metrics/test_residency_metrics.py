"""Adapter residency in /metrics, read the way llm-d's `lora-load-state-scorer` reads it.

The reader below follows llm-d-router PR #2792 (its metrics extractor and docs/proposals' "LoRA
Adapter Residency" protocol) and vLLM PR #54830, written from their description, not from our code:
- `vllm:lora_adapter_loaded{adapter_name,level,pinned,rank}`: a series at 0 or without an
  `adapter_name` is absent; gpu outranks cpu; `pinned="true"` is pinned; `rank` parses as an int;
- `vllm:num_gpu_loaded_lora_adapters{model_name}`: present from start-up (so an empty resident set is
  reported, not unknown), `model_name` = the base model (requests for it need no adapter);
- `vllm:max_gpu_lora_adapters`: the GPU slots, present from start-up;
- `vllm:lora_adapter_load_seconds{transition=load|activate}`: mean = sum / count per transition.
The engine side is real: peft adapters on the tiny Llama in a real adapter cache and its manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from adapters.types import AdapterRef
from api.metrics.prometheus import Metrics
from base_engine.lora import LoraManager, make_lora_manager
from base_engine.outputs import AdapterCacheStats, EngineStats
from tests.harness.peft_adapters import save_peft_adapter, tiny_shapes
from tests.harness.wait import wait_for


@dataclass
class LoadState:
    level: str
    pinned: bool = False
    rank: int = 0


@dataclass
class ScorerView:
    loaded: dict[str, LoadState] | None = None  # None: the server reports no residency
    gpu_loaded: int = 0
    max_slots: int = 0
    base_model: str = ""
    mean_seconds: dict[str, float] = field(default_factory=dict)  # transition -> mean


def scorer_view(exposition: str) -> ScorerView:
    view = ScorerView()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == "vllm:lora_adapter_loaded":
                view.loaded = {} if view.loaded is None else view.loaded
                name = s.labels.get("adapter_name", "")
                if s.value == 0 or not name:
                    continue
                rank = int(s.labels["rank"]) if s.labels.get("rank", "").isdigit() else 0
                state = LoadState(s.labels["level"], s.labels.get("pinned") == "true", rank)
                old = view.loaded.get(name)
                if old is None or (old.level == "cpu" and state.level == "gpu"):
                    view.loaded[name] = state
            elif s.name == "vllm:num_gpu_loaded_lora_adapters":
                view.loaded = {} if view.loaded is None else view.loaded
                view.gpu_loaded = max(view.gpu_loaded, int(s.value))
                view.base_model = s.labels.get("model_name", "")
            elif s.name == "vllm:max_gpu_lora_adapters":
                view.max_slots = max(view.max_slots, int(s.value))
            elif s.name == "vllm:lora_adapter_load_seconds_sum":
                sums[s.labels["transition"]] = sums.get(s.labels["transition"], 0.0) + s.value
            elif s.name == "vllm:lora_adapter_load_seconds_count":
                counts[s.labels["transition"]] = counts.get(s.labels["transition"], 0.0) + s.value
    view.mean_seconds = {t: sums[t] / counts[t] for t in counts if counts[t] > 0}
    return view


def engine_stats(adapters: AdapterCacheStats) -> EngineStats:
    return EngineStats(
        num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=10, num_preemptions=0,
        num_prefix_queries=0, num_prefix_hits=0, num_steps=0, adapters=adapters,
    )  # fmt: skip


def scrape(metrics: Metrics, manager: LoraManager) -> ScorerView:
    metrics.update_engine(engine_stats(manager.stats([], [])))
    return scorer_view(metrics.render()[0].decode())


@pytest.fixture
def manager(tmp_path: Path):
    lora = make_lora_manager(
        tiny_shapes(), max_loras=2, max_lora_rank=8, max_cpu_loras=4, max_wait_s=5.0,
        dtype=torch.float32, device=torch.device("cpu"), fetch=lambda ref: Path(ref.source),
    )  # fmt: skip
    yield lora
    lora.close()


def adapter(tmp_path: Path, tenant: str, name: str, *, rank: int, seed: int) -> AdapterRef:
    directory = save_peft_adapter(tmp_path / f"{tenant}-{name}", r=rank, target_modules=["q_proj"], seed=seed)
    return AdapterRef(id=f"{tenant}/{name}@1", sha256=f"{seed:064x}", source=str(directory))


def load(manager: LoraManager, ref: AdapterRef) -> None:
    def resident() -> bool:
        assert not manager.cache.poll(), "load failed"
        return ref.id in manager.cache.host

    manager.cache.request_load(ref)
    wait_for(resident, 30.0, interval=0.02, what=f"{ref.id} loaded")


def test_the_scorer_reads_residency_levels_pins_ranks_and_slots(tmp_path: Path, manager: LoraManager) -> None:
    metrics = Metrics(registry=CollectorRegistry(), model_name="base-model")
    view = scrape(metrics, manager)
    # Before any adapter: residency is reported (empty), capacity known, the base model named.
    assert (view.loaded, view.gpu_loaded, view.max_slots, view.base_model) == ({}, 0, 2, "base-model")

    bot, sql, faq = (adapter(tmp_path, "t1", n, rank=r, seed=i) for i, (n, r) in
                     enumerate((("bot", 4), ("sql", 8), ("faq", 2))))  # fmt: skip
    for ref in (bot, sql, faq):
        load(manager, ref)
    slot = manager.cache.acquire(bot)
    assert slot is not None
    manager.pin(faq)  # a pin holds a slot
    view = scrape(metrics, manager)
    # adapter_name is the name clients send in `model`, not the engine's tenant-scoped id
    assert view.loaded == {
        "bot": LoadState("gpu", False, 4),
        "sql": LoadState("cpu", False, 8),
        "faq": LoadState("gpu", True, 2),
    }
    assert view.gpu_loaded == 2 and view.max_slots == 2
    assert view.mean_seconds["load"] > 0 and "activate" in view.mean_seconds

    manager.cache.release(slot)
    manager.evict([bot.id])
    view = scrape(metrics, manager)
    assert view.loaded is not None and "bot" not in view.loaded  # evicted: its series is gone
    assert view.gpu_loaded == 1


def test_load_durations_are_observed_once_each(tmp_path: Path, manager: LoraManager) -> None:
    metrics = Metrics(registry=CollectorRegistry(), model_name="m")
    load(manager, adapter(tmp_path, "t1", "bot", rank=4, seed=0))
    for _ in range(3):  # the sampler refreshes every second: the same load must count once
        scrape(metrics, manager)
    load(manager, adapter(tmp_path, "t1", "sql", rank=4, seed=1))
    scrape(metrics, manager)
    text = metrics.render()[0].decode()
    count = next(
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "vllm:lora_adapter_load_seconds_count" and s.labels["transition"] == "load"
    )  # fmt: skip
    assert count == 2
    expected = sum(manager.cache.stats.recent_load_s) / 2
    assert scorer_view(text).mean_seconds["load"] == pytest.approx(expected)


def test_one_name_in_two_tenants_is_one_series_at_its_best_level() -> None:
    metrics = Metrics(registry=CollectorRegistry(), model_name="m")
    stats = AdapterCacheStats(
        num_slots=2, num_gpu=1, num_cpu=2, residency={"t1/bot@1": "cpu", "t2/bot@3": "gpu"},
        pinned=["t1/bot@1"], ranks={"t1/bot@1": 8, "t2/bot@3": 4},
    )  # fmt: skip
    metrics.update_engine(engine_stats(stats))
    text = metrics.render()[0].decode()
    series = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "vllm:lora_adapter_loaded"]  # fmt: skip
    assert len(series) == 1
    assert scorer_view(text).loaded == {"bot": LoadState("gpu", True, 8)}
