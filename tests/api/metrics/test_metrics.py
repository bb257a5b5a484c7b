"""Metrics: the exposition parses with Prometheus' own parser, carries vLLM's names and buckets, and
moves with finished requests and engine snapshots; the recent-samples ring matches a numpy oracle."""

from __future__ import annotations

import random

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from api.metrics.prometheus import Metrics
from api.metrics.series import one_two_five_buckets
from api.metrics.window import RecentStats
from base_engine.outputs import AdapterCacheStats, AdapterRequests, EngineStats, RequestMetrics, RequestOutput
from tests.harness.clock import FakeClock
from tests.harness.metric_names import REQUIRED_METRIC_NAMES

# From ../shared/reference/platform.md section 2.1 (vLLM V1 loggers.py), not from our code.
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10,
                     20, 40, 80, 160, 640, 2560]  # fmt: skip
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20,
                    40, 80]  # fmt: skip
VLLM_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960,
                        1920, 7680]  # fmt: skip


def output(
    rid: str, *, prompt: int, completion: int, cached: int = 0, reason: str = "stop", ttft: float = 0.2,
    itl: list[float] | None = None, queue: float = 0.05, with_metrics: bool = True,
) -> RequestOutput:  # fmt: skip
    itl = itl if itl is not None else [0.02] * max(0, completion - 1)
    metrics = RequestMetrics(
        queue_time_s=queue, prefill_time_s=ttft - queue, ttft_s=ttft, e2e_s=ttft + sum(itl), inter_token_s=itl
    )
    return RequestOutput(
        request_id=rid, prompt_token_ids=list(range(prompt)), token_ids=list(range(completion)), text="",
        finish_reason=reason, num_cached_tokens=cached, metrics=metrics if with_metrics else None,
    )  # fmt: skip


def stats(**changes: object) -> EngineStats:
    fields: dict[str, object] = dict(
        num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=100, num_preemptions=0,
        num_prefix_queries=0, num_prefix_hits=0, num_steps=0, adapters=AdapterCacheStats(),
    )  # fmt: skip
    fields.update(changes)
    return EngineStats(**fields)  # type: ignore[arg-type]


def samples(
    metrics: Metrics, *, include_tenants: bool = True
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    payload, content_type = metrics.render(include_tenants=include_tenants)
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(payload.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """The sample with exactly these labels; a vLLM series (`model_name`) also has vLLM's engine="0"."""
    if "model_name" in labels:
        labels = {"engine": "0", **labels}
    return samples(metrics).get((name, tuple(sorted(labels.items()))), 0.0)


def test_names_and_buckets_follow_vllm() -> None:
    metrics = Metrics(model_name="base-7b")
    metrics.update_engine(stats())
    payload, _ = metrics.render(include_tenants=True)
    families = {f.name: f for f in text_string_to_metric_families(payload.decode())}
    for name in REQUIRED_METRIC_NAMES:
        assert name in families, name
    assert families["vllm:num_preemptions"].type == "counter"
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    for name, expected in (
        ("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds", VLLM_ITL_BUCKETS),
        ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_BUCKETS),
        ("vllm:request_queue_time_seconds", VLLM_REQUEST_BUCKETS),
        ("vllm:request_prefill_time_seconds", VLLM_REQUEST_BUCKETS),
    ):
        bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert bounds == [float(b) for b in expected] + [float("inf")], name
        assert all(s.labels["model_name"] == "base-7b" for s in families[name].samples)
    assert one_two_five_buckets(120) == [1, 2, 5, 10, 20, 50, 100]


def test_vllm_series_carry_the_engine_label() -> None:
    """vLLM labels its series (model_name, engine) with engine = the engine core's index, "0" for one
    engine (`per_engine_labelvalues` in vllm/v1/metrics/loggers.py; llm-d's residency extractor reads
    it too); only `vllm:lora_requests_info` has neither label."""
    metrics = Metrics(model_name="base-7b")
    metrics.update_engine(stats())
    metrics.set_cache_config(
        block_size=16, cache_dtype="float32", enable_prefix_caching=True, num_gpu_blocks=8
    )
    vllm = [(name, dict(labels)) for (name, labels) in samples(metrics) if name.startswith("vllm:")]
    assert len({name for name, _ in vllm}) > 20
    for name, labels in vllm:
        if name == "vllm:lora_requests_info":
            assert "engine" not in labels and "model_name" not in labels
            continue
        assert labels.get("engine") == "0", (name, labels)
        if name != "vllm:cache_config_info":
            assert labels["model_name"] == "base-7b", (name, labels)


def test_finished_requests_move_counters_and_histograms() -> None:
    metrics = Metrics(model_name="m")
    metrics.observe_finished(output("a", prompt=7, completion=4, cached=3), tenant="acme", adapter="bot@1")
    metrics.observe_finished(output("b", prompt=5, completion=0, reason="abort"), tenant="acme", adapter=None)
    metrics.observe_finished(
        output("c", prompt=2, completion=0, reason="error", with_metrics=False), tenant="beta", adapter=None
    )
    assert value(metrics, "vllm:prompt_tokens_total", model_name="m") == 14
    assert value(metrics, "vllm:generation_tokens_total", model_name="m") == 4
    for reason, n in (("stop", 1), ("abort", 1), ("error", 1)):
        assert value(metrics, "vllm:request_success_total", model_name="m", finished_reason=reason) == n
    assert value(metrics, "loraserve_tenant_requests_total", tenant="acme") == 2
    assert value(metrics, "loraserve_tenant_prompt_tokens_total", tenant="acme") == 12
    assert value(metrics, "loraserve_tenant_cached_prompt_tokens_total", tenant="acme") == 3
    assert value(metrics, "loraserve_tenant_generation_tokens_total", tenant="acme") == 4
    assert value(metrics, "loraserve_tenant_requests_total", tenant="beta") == 1
    # TTFT only for a request that produced a token; ITL once per gap; e2e for every engine-run request.
    assert value(metrics, "vllm:time_to_first_token_seconds_count", model_name="m") == 1
    assert value(metrics, "vllm:time_to_first_token_seconds_sum", model_name="m") == pytest.approx(0.2)
    assert value(metrics, "vllm:inter_token_latency_seconds_count", model_name="m") == 3
    assert value(metrics, "vllm:e2e_request_latency_seconds_count", model_name="m") == 2
    assert value(metrics, "vllm:time_to_first_token_seconds_bucket", model_name="m", le="0.25") == 1
    assert value(metrics, "vllm:time_to_first_token_seconds_bucket", model_name="m", le="0.1") == 0


def test_tenant_labels_are_capped() -> None:
    metrics = Metrics(max_tenant_labels=2)
    for tenant in ("t1", "t2", "t3", "t4", "t1"):
        metrics.observe_finished(output(tenant, prompt=1, completion=1), tenant=tenant, adapter=None)
    tenants = {dict(labels).get("tenant") for (name, labels) in samples(metrics) if "tenant_requests" in name}
    assert tenants == {"t1", "t2", "other"}
    assert value(metrics, "loraserve_tenant_requests_total", tenant="other") == 2


def test_engine_snapshots_set_gauges_and_feed_counters_from_totals() -> None:
    metrics = Metrics(registry=CollectorRegistry(), model_name="m", wall_clock=lambda: 1234.0)
    adapters = AdapterCacheStats(
        num_slots=4,
        num_gpu=2,
        num_cpu=3,
        loads=3,
        load_seconds=1.5,
        hits=10,
        misses=3,
        evictions=1,
        cpu_evictions=0,
        per_adapter={"t/bot@1": AdapterRequests(running=2), "t/sql@1": AdapterRequests(waiting=1)},
    )
    metrics.update_engine(
        stats(num_running=3, num_waiting=2, num_kv_blocks_used=25, num_preemptions=4, num_prefix_queries=100,
              num_prefix_hits=40, adapters=adapters),
        disk_count=5, disk_bytes=12345,
    )  # fmt: skip
    assert value(metrics, "vllm:num_requests_running", model_name="m") == 3
    assert value(metrics, "vllm:num_requests_waiting", model_name="m") == 2
    assert value(metrics, "vllm:kv_cache_usage_perc", model_name="m") == 0.25
    assert value(metrics, "vllm:num_preemptions_total", model_name="m") == 4
    assert value(metrics, "vllm:prefix_cache_hits_total", model_name="m") == 40
    assert value(metrics, "loraserve_adapter_cache_adapters", tier="gpu") == 2
    assert value(metrics, "loraserve_adapter_cache_adapters", tier="disk") == 5
    assert value(metrics, "loraserve_adapter_cache_bytes", tier="disk") == 12345
    assert value(metrics, "loraserve_adapter_loads_total") == 3
    assert value(metrics, "loraserve_adapter_cache_evictions_total", tier="gpu") == 1
    info = {labels: v for (name, labels), v in samples(metrics).items() if name == "vllm:lora_requests_info"}
    assert info == {  # named as clients send them in `model`: no tenant id
        (
            ("max_lora", "4"),
            ("running_lora_adapters", "bot"),
            ("waiting_lora_adapters", "sql"),
        ): 1234.0
    }
    # Totals move by their increase; a new engine (totals restart from 0) keeps the counter monotonic.
    metrics.update_engine(stats(num_preemptions=6, num_prefix_queries=150, num_prefix_hits=40))
    assert value(metrics, "vllm:num_preemptions_total", model_name="m") == 6
    assert value(metrics, "vllm:prefix_cache_queries_total", model_name="m") == 150
    metrics.update_engine(stats(num_preemptions=1))
    assert value(metrics, "vllm:num_preemptions_total", model_name="m") == 7
    assert value(metrics, "vllm:num_requests_running", model_name="m") == 0
    info = [labels for (name, labels) in samples(metrics) if name == "vllm:lora_requests_info"]
    assert len(info) == 1  # one series at a time, however often the adapters change


def test_recent_samples_match_a_numpy_oracle() -> None:
    clock, wall = FakeClock(), FakeClock()
    recent = RecentStats(interval_s=2.0, window_s=20.0, latency_window_s=60.0, clock=clock, wall_clock=wall)
    metrics = Metrics(recent=recent)
    rng = random.Random(0)
    ttfts, itls = [], []
    for i in range(40):
        ttft, gaps = rng.uniform(0.05, 2.0), [rng.uniform(0.01, 0.2) for _ in range(rng.randint(0, 5))]
        ttfts.append(ttft)
        itls += gaps
        metrics.observe_finished(
            output(f"r{i}", prompt=10, completion=len(gaps) + 1, ttft=ttft, itl=gaps),
            tenant="t",
            adapter="a@1",
        )
    metrics.update_engine(stats(num_kv_blocks_used=50, num_prefix_queries=100, num_prefix_hits=10))
    clock.now += 1.0
    metrics.update_engine(stats(num_prefix_queries=200, num_prefix_hits=90))  # within the interval: no sample
    clock.now += 1.5
    metrics.update_engine(stats(num_prefix_queries=300, num_prefix_hits=90, num_preemptions=2))
    series = metrics.timeseries()
    assert len(series["t"]) == 2  # type: ignore[arg-type]
    cols = series["series"]
    assert isinstance(cols, dict)
    for p in (50, 95, 99):
        assert cols[f"ttft_p{p}"][0] == np.percentile(ttfts, p, method="inverted_cdf")
        assert cols[f"itl_p{p}"][0] == np.percentile(itls, p, method="inverted_cdf")
    assert cols["kv_cache_usage"] == [0.5, 0.0]
    assert cols["prefix_cache_hit_rate"] == [None, pytest.approx(80 / 200)]  # counted since the last sample
    assert cols["preemptions"] == [None, 2]
    assert series["top_adapters"] == [{"adapter": "a@1", "requests": 40}]
    # Observations older than the latency window drop out; the ring keeps window_s / interval_s samples.
    for _ in range(40):
        clock.now += 2.0
        metrics.update_engine(stats())
    cols = metrics.timeseries()["series"]
    assert isinstance(cols, dict)
    assert len(cols["ttft_p50"]) == 10 and cols["ttft_p50"][-1] is None


def test_queue_time_is_split_by_priority_class() -> None:
    metrics = Metrics(model_name="m")
    urgent, background = (
        output("u", prompt=3, completion=2, queue=0.02),
        output("b", prompt=3, completion=2, queue=7.0),
    )
    urgent.metrics.priority, background.metrics.priority = -1, 5  # type: ignore[union-attr]
    for out in (urgent, background):
        metrics.observe_finished(out, tenant="acme", adapter=None)
    name = "loraserve_request_queue_time_seconds"
    assert value(metrics, f"{name}_count", priority="-1") == 1
    assert value(metrics, f"{name}_sum", priority="-1") == pytest.approx(0.02)
    assert value(metrics, f"{name}_bucket", priority="-1", le="0.025") == 1
    assert value(metrics, f"{name}_sum", priority="5") == pytest.approx(7.0)
    assert value(metrics, f"{name}_bucket", priority="5", le="5.0") == 0
    assert value(metrics, f"{name}_bucket", priority="5", le="10.0") == 1
