"""Prometheus metrics: vLLM-compatible names so existing dashboards work, plus `loraserve_*`. This
module decides what is counted when (a request finishes, engine stats arrive) and renders; the series
themselves (names, labels, buckets, after vLLM's V1 engine) are defined in api/metrics/series.py.
`vllm:kv_cache_usage_perc` is the share of KV blocks held by live requests (blocks that only the
prefix cache remembers count as free), as vLLM computes it.

Tenant privacy: `/metrics` is unauthenticated, so what it shows by default names no tenant. The
per-tenant counters (`tenant` label, nothing finer: adapter detail belongs to the usage API, and at
most `max_tenant_labels` tenants get their own series, the rest share `tenant="other"`) live in a
registry of their own, rendered only on request (`render(include_tenants=True)`: the operator
opted in, or the scrape carried the metrics token). `vllm:lora_requests_info` names adapters as
clients send them in `model` (vLLM's convention: the adapter's name, no tenant id); with
`tenant_labels=True` it shows the engine's full ids (`<tenant id>/<name>@<version>`) instead.

Fleet: with `replica` set (api/fleet/agent.py sets it in fleet mode), every series of
both registries carries a `replica` label, added when rendering (`_WithLabel`), so each replica's
scrape is distinguishable and the fleet's snapshots merge without collisions.

Token counters count engine work: an HTTP request with n=2 runs its prompt twice and counts it
twice here, while the usage API bills the prompt once (OpenAI's rule for `n`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from api.context import RequestContext
from api.metrics.iteration_tokens import IterationTokens
from api.metrics.residency import ResidencyMetrics
from api.metrics.series import (
    ENGINE,
    LoraserveSeries,
    ResidencySeries,
    VllmSeries,
)
from api.metrics.spec_decode import SpecDecodeMetrics
from api.metrics.window import RecentStats
from base_engine.outputs import AdapterCacheStats, EngineStats, RequestOutput

OTHER_TENANT = "other"


def adapter_label(ref_id: str) -> str:
    """An engine adapter id as clients name the adapter in `model`: "<tenant id>/<name>@<version>"
    -> "<name>" (what /v1/models lists); ids of another form (offline paths) are kept as they are."""
    tenant, slash, rest = ref_id.partition("/")
    name, at, version = rest.rpartition("@")
    return name if slash and at and name and version.isdigit() and "/" not in rest else ref_id


class _WithLabel:
    """A registry's families with one more label on every sample (a constant, e.g. the replica)."""

    def __init__(self, registry: Collector, name: str, value: str) -> None:
        self.registry, self.name, self.value = registry, name, value

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [s._replace(labels={**s.labels, self.name: self.value}) for s in family.samples]
            yield copy


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        model_name: str = "loraserve",
        max_model_len: int = 8192,
        max_tenant_labels: int = 1000,
        recent: RecentStats | None = None,
        wall_clock: Callable[[], float] = time.time,
        tenant_labels: bool = False,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenant_registry = CollectorRegistry()  # series that name tenants: rendered on request
        self.tenant_labels = tenant_labels
        self.model_name = model_name
        self.max_tenant_labels = max_tenant_labels
        self.recent = recent if recent is not None else RecentStats()
        self.wall_clock = wall_clock
        self._tenants: set[str] = set()
        self._lock = threading.Lock()
        self.replica: str | None = None  # fleet mode: the `replica` label on every series
        self.vllm = VllmSeries(self.registry, model_name, max_model_len)
        self.own = LoraserveSeries(self.registry, self.tenant_registry)
        self.iteration_tokens = IterationTokens(self.registry, model_name)  # api/metrics/iteration_tokens.py
        self.residency = ResidencyMetrics(ResidencySeries(self.registry, model_name), model_name)
        self.spec_decode = SpecDecodeMetrics(self.registry, model_name)  # api/metrics/spec_decode.py

    # ---- updates ------------------------------------------------------------------------------

    def observe_finished(self, out: RequestOutput, *, tenant: str, adapter: str | None) -> None:
        """Count a finished engine request (any finish reason); thread-safe."""
        with self._lock:
            label = self._tenant_label(tenant)
        v, own = self.vllm, self.own
        v.request_success.labels(self.model_name, ENGINE, out.finish_reason or "unknown").inc()
        v.prompt_tokens.inc(out.num_prompt_tokens)
        v.generation_tokens.inc(out.num_completion_tokens)
        own.tenant_requests.labels(label).inc()
        own.tenant_prompt_tokens.labels(label).inc(out.num_prompt_tokens)
        own.tenant_cached_tokens.labels(label).inc(out.num_cached_tokens)
        own.tenant_generation_tokens.labels(label).inc(out.num_completion_tokens)
        v.request_prompt_tokens.observe(out.num_prompt_tokens)
        v.request_generation_tokens.observe(out.num_completion_tokens)
        m = out.metrics
        if m is not None:  # None: failed before the engine took it
            v.e2e.observe(m.e2e_s)
            v.queue_time.observe(m.queue_time_s)
            own.queue_time_by_priority.labels(str(m.priority)).observe(m.queue_time_s)
            v.inference_time.observe(max(0.0, m.e2e_s - m.queue_time_s))
            if out.num_completion_tokens > 0:
                v.ttft.observe(m.ttft_s)
                v.prefill_time.observe(m.prefill_time_s)
                v.decode_time.observe(max(0.0, m.e2e_s - m.ttft_s))
                for gap in m.inter_token_s:
                    v.itl.observe(gap)
                    v.tpot.observe(gap)
                # vLLM's per-request mean: decode time over the tokens after the first (0 for one token)
                num_after_first = out.num_completion_tokens - 1
                v.request_tpot.observe(
                    max(0.0, m.e2e_s - m.ttft_s) / num_after_first if num_after_first > 0 else 0.0
                )
        self.recent.observe(out, adapter=adapter)

    def request_finished(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        """An HTTP request has ended: count each of its engine requests, then the request."""
        adapter = f"{ctx.adapter_name}@{ctx.adapter_version}" if ctx.adapter_name else None
        for out in finals:
            self.observe_finished(out, tenant=ctx.tenant_name, adapter=adapter)
        self.observe_request(finals)

    def observe_request(self, finals: list[RequestOutput]) -> None:
        """An HTTP request's end: the most tokens any of its choices generated (vLLM counts a request
        with n choices, or a prompt list, once per prompt group; here once per HTTP request)."""
        self.vllm.request_max_generation_tokens.observe(
            max((o.num_completion_tokens for o in finals), default=0)
        )

    def set_cache_config(
        self, *, block_size: int, num_gpu_blocks: int, cache_dtype: str, enable_prefix_caching: bool
    ) -> None:
        """`vllm:cache_config_info` (value 1; the KV cache's configuration in its labels)."""
        self.vllm.cache_config_info.clear()
        self.vllm.cache_config_info.labels(
            str(block_size), cache_dtype, str(enable_prefix_caching), "0", str(num_gpu_blocks), ENGINE
        ).set(1)

    def _tenant_label(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) >= self.max_tenant_labels:
            return OTHER_TENANT
        self._tenants.add(tenant)
        return tenant

    def update_engine(self, stats: EngineStats, *, disk_count: int = 0, disk_bytes: int = 0) -> None:
        """Refresh gauges and engine-counted totals from a stats snapshot (call every second or two)."""
        v = self.vllm
        with self._lock:
            v.num_running.set(stats.num_running)
            v.num_waiting.set(stats.num_waiting)
            v.kv_usage.set(stats.kv_cache_usage)
            v.preemptions.update(stats.num_preemptions)
            v.prefix_queries.update(stats.num_prefix_queries)
            v.prefix_hits.update(stats.num_prefix_hits)
            self.iteration_tokens.update(stats.iteration_token_counts, stats.iteration_tokens_sum)
            self.spec_decode.update(stats.spec_decode)
            self._update_adapters(stats.adapters, disk_count, disk_bytes)
            self.recent.sample(stats)

    def _update_adapters(self, a: AdapterCacheStats, disk_count: int, disk_bytes: int) -> None:
        for tier, count, size in (
            ("gpu", a.num_gpu, a.gpu_bytes),
            ("cpu", a.num_cpu, a.cpu_bytes),
            ("disk", disk_count, disk_bytes),
        ):
            self.own.adapters_resident.labels(tier).set(float(count))
            self.own.adapter_bytes.labels(tier).set(float(size))
        for total, value in (
            (self.own.adapter_loads, a.loads),
            (self.own.adapter_load_seconds, a.load_seconds),
            (self.own.adapter_load_failures, a.load_failures),
            (self.own.adapter_hits, a.hits),
            (self.own.adapter_misses, a.misses),
            (self.own.gpu_evictions, a.evictions),
            (self.own.cpu_evictions, a.cpu_evictions),
        ):
            total.update(float(value))
        self.residency.update(a, self._adapter_label)
        running: set[str] = set()
        waiting: set[str] = set()
        for ref_id, counts in a.per_adapter.items():
            label = self._adapter_label(ref_id)
            if counts.running:
                running.add(label)
            if counts.waiting:
                waiting.add(label)
        # One series at a time: vLLM's labels change every sample, and old label sets must not pile up.
        self.vllm.lora_info.clear()
        self.vllm.lora_info.labels(
            str(a.num_slots), ",".join(sorted(running)), ",".join(sorted(waiting))
        ).set(self.wall_clock())

    def _adapter_label(self, ref_id: str) -> str:
        return ref_id if self.tenant_labels else adapter_label(ref_id)

    # ---- reading ------------------------------------------------------------------------------

    def render(self, *, include_tenants: bool = False) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type, for `GET /metrics`; the per-tenant
        series only with `include_tenants` (two expositions of disjoint families concatenate)."""
        registries: list[Collector] = [self.registry, *([self.tenant_registry] if include_tenants else [])]
        if self.replica is not None:
            registries = [_WithLabel(r, "replica", self.replica) for r in registries]
        return b"".join(generate_latest(r) for r in registries), CONTENT_TYPE_LATEST

    def timeseries(self) -> dict[str, object]:
        return self.recent.timeseries()
