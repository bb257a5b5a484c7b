"""Prometheus metrics: vLLM-compatible names so existing dashboards work, plus `loraserve_*`.

Names, types and buckets follow vLLM's V1 engine (`vllm-project/vllm docs/design/metrics.md`,
`vllm/v1/metrics/loggers.py`, summarized in ../shared/reference/platform.md section 2.1): every
vLLM metric carries a `model_name` label with the served base model's name.
`vllm:kv_cache_usage_perc` is the share of KV blocks held by live requests (blocks that only the
prefix cache remembers count as free), as vLLM computes it.

Tenant privacy: `/metrics` is unauthenticated, so what it shows by default names no tenant. The
per-tenant counters (`tenant` label, nothing finer: adapter detail belongs to the usage API, and at
most `max_tenant_labels` tenants get their own series, the rest share `tenant="other"`) live in a
registry of their own, rendered only on request (`render(include_tenants=True)`: the operator
opted in, or the scrape carried the metrics token). `vllm:lora_requests_info` names adapters as
clients send them in `model` (vLLM's convention: the adapter's name, no tenant id); with
`tenant_labels=True` it shows the engine's full ids (`<tenant id>/<name>@<version>`) instead.

Fleet (issue 16): with `replica` set (api/fleet/agent.py sets it in fleet mode), every series of
both registries carries a `replica` label, added when rendering (`_WithLabel`), so each replica's
scrape is distinguishable and the fleet's snapshots merge without collisions.

No `*_created` series: vLLM's dashboards never read them and they double a scrape's series
(`disable_created_metrics`, process-wide, at import).

Token counters count engine work: an HTTP request with n=2 runs its prompt twice and counts it
twice here, while the usage API bills the prompt once (OpenAI's rule for `n`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from api.metrics_window import RecentStats
from base_engine.outputs import EngineStats, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
OTHER_TENANT = "other"

disable_created_metrics()


def one_two_five_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count histograms)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


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


class _Total:
    """Feeds a Prometheus counter from a cumulative total read elsewhere (the engine's stats)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last: float | None = None

    def update(self, total: float) -> None:
        # A total below the last one means a new engine counting from 0: count all of it again.
        previous = 0.0 if self.last is None or total < self.last else self.last
        self.counter.inc(total - previous)
        self.last = total


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
        self._define_vllm(max_model_len)
        self._define_loraserve()

    # ---- definitions --------------------------------------------------------------------------

    def _define_vllm(self, max_model_len: int) -> None:
        r, base = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, base, registry=r).labels(self.model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, base, registry=r).labels(self.model_name)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, base, buckets=tuple(buckets), registry=r).labels(self.model_name)

        self.num_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = _Total(
            counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        )
        self.prefix_queries = _Total(counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens."))
        self.prefix_hits = _Total(counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens."))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter(
            "vllm:request_success",
            "Count of finished requests by finish reason.",
            [*base, "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS
        )
        self.tpot = histogram(  # the same gaps under vLLM's older name, which dashboards still read
            "vllm:time_per_output_token_seconds",
            "Time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", REQUEST_TIME_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time spent in the WAITING phase.", REQUEST_TIME_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Time spent in the PREFILL phase.", REQUEST_TIME_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Time spent in the DECODE phase.", REQUEST_TIME_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "Time spent in the RUNNING phase.", REQUEST_TIME_BUCKETS
        )
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed per request.",
            token_buckets,
        )
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "cache_dtype", "enable_prefix_caching", "num_cpu_blocks", "num_gpu_blocks"],
            registry=r,
        )
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (value: wall-clock time of the sample).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )

    def _define_loraserve(self) -> None:
        r, tenants = self.registry, self.tenant_registry
        self.adapters_resident = Gauge(
            "loraserve_adapter_cache_adapters", "Adapters resident per cache tier.", ["tier"], registry=r
        )
        self.adapter_bytes = Gauge(
            "loraserve_adapter_cache_bytes",
            "Bytes of adapters resident per cache tier.",
            ["tier"],
            registry=r,
        )

        def c(name: str, doc: str, labels: tuple[str, ...] = (), registry: CollectorRegistry = r) -> Counter:
            return Counter(name, doc, list(labels), registry=registry)

        self.adapter_loads = _Total(c("loraserve_adapter_loads", "Adapters loaded into host memory."))
        self.adapter_load_seconds = _Total(
            c("loraserve_adapter_load_seconds", "Seconds spent loading adapters.")
        )
        self.adapter_load_failures = _Total(
            c("loraserve_adapter_load_failures", "Adapter loads that failed.")
        )
        self.adapter_hits = _Total(
            c("loraserve_adapter_cache_hits", "Activations finding the adapter in a slot.")
        )
        self.adapter_misses = _Total(
            c("loraserve_adapter_cache_misses", "Activations copying it into a slot.")
        )
        evictions = c("loraserve_adapter_cache_evictions", "Adapters evicted from a cache tier.", ("tier",))
        self.gpu_evictions = _Total(evictions.labels("gpu"))
        self.cpu_evictions = _Total(evictions.labels("cpu"))
        self.tenant_requests = c(
            "loraserve_tenant_requests", "Finished engine requests per tenant.", ("tenant",), tenants
        )
        self.tenant_prompt_tokens = c(
            "loraserve_tenant_prompt_tokens", "Prompt tokens per tenant.", ("tenant",), tenants
        )
        self.tenant_cached_tokens = c(
            "loraserve_tenant_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            ("tenant",),
            tenants,
        )
        self.tenant_generation_tokens = c(
            "loraserve_tenant_generation_tokens", "Generated tokens per tenant.", ("tenant",), tenants
        )

    # ---- updates ------------------------------------------------------------------------------

    def observe_finished(self, out: RequestOutput, *, tenant: str, adapter: str | None) -> None:
        """Count a finished engine request (any finish reason); thread-safe."""
        with self._lock:
            label = self._tenant_label(tenant)
        self.request_success.labels(self.model_name, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_completion_tokens)
        self.tenant_requests.labels(label).inc()
        self.tenant_prompt_tokens.labels(label).inc(out.num_prompt_tokens)
        self.tenant_cached_tokens.labels(label).inc(out.num_cached_tokens)
        self.tenant_generation_tokens.labels(label).inc(out.num_completion_tokens)
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(out.num_completion_tokens)
        m = out.metrics
        if m is not None:  # None: failed before the engine took it
            self.e2e.observe(m.e2e_s)
            self.queue_time.observe(m.queue_time_s)
            self.inference_time.observe(max(0.0, m.e2e_s - m.queue_time_s))
            if out.num_completion_tokens > 0:
                self.ttft.observe(m.ttft_s)
                self.prefill_time.observe(m.prefill_time_s)
                self.decode_time.observe(max(0.0, m.e2e_s - m.ttft_s))
                for gap in m.inter_token_s:
                    self.itl.observe(gap)
                    self.tpot.observe(gap)
                # vLLM's per-request mean: decode time over the tokens after the first (0 for one token)
                num_after_first = out.num_completion_tokens - 1
                self.request_tpot.observe(
                    max(0.0, m.e2e_s - m.ttft_s) / num_after_first if num_after_first > 0 else 0.0
                )
        self.recent.observe(out, adapter=adapter)

    def observe_request(self, finals: list[RequestOutput]) -> None:
        """An HTTP request's end: the most tokens any of its choices generated (vLLM counts a request
        with n choices, or a prompt list, once per prompt group; here once per HTTP request)."""
        self.request_max_generation_tokens.observe(max((o.num_completion_tokens for o in finals), default=0))

    def set_cache_config(
        self, *, block_size: int, num_gpu_blocks: int, cache_dtype: str, enable_prefix_caching: bool
    ) -> None:
        """`vllm:cache_config_info` (value 1; the KV cache's configuration in its labels)."""
        self.cache_config_info.clear()
        self.cache_config_info.labels(
            str(block_size), cache_dtype, str(enable_prefix_caching), "0", str(num_gpu_blocks)
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
        with self._lock:
            self.num_running.set(stats.num_running)
            self.num_waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            self.preemptions.update(stats.num_preemptions)
            self.prefix_queries.update(stats.num_prefix_queries)
            self.prefix_hits.update(stats.num_prefix_hits)
            self._update_adapters(stats.adapters, disk_count, disk_bytes)
            self.recent.sample(stats)

    def _update_adapters(self, a: dict[str, object], disk_count: int, disk_bytes: int) -> None:
        def num(key: str) -> float:
            value = a.get(key, 0)
            return float(value) if isinstance(value, int | float) else 0.0

        for tier, count, size in (
            ("gpu", num("num_gpu"), num("gpu_bytes")),
            ("cpu", num("num_cpu"), num("cpu_bytes")),
            ("disk", float(disk_count), float(disk_bytes)),
        ):
            self.adapters_resident.labels(tier).set(count)
            self.adapter_bytes.labels(tier).set(size)
        for total, key in (
            (self.adapter_loads, "loads"),
            (self.adapter_load_seconds, "load_seconds"),
            (self.adapter_load_failures, "load_failures"),
            (self.adapter_hits, "hits"),
            (self.adapter_misses, "misses"),
            (self.gpu_evictions, "evictions"),
            (self.cpu_evictions, "cpu_evictions"),
        ):
            total.update(num(key))
        running: set[str] = set()
        waiting: set[str] = set()
        per_adapter = a.get("per_adapter", {})
        if isinstance(per_adapter, dict):
            for ref_id, counts in per_adapter.items():
                label = ref_id if self.tenant_labels else adapter_label(ref_id)
                if isinstance(counts, dict) and counts.get("running"):
                    running.add(label)
                if isinstance(counts, dict) and counts.get("waiting"):
                    waiting.add(label)
        # One series at a time: vLLM's labels change every sample, and old label sets must not pile up.
        self.lora_info.clear()
        self.lora_info.labels(
            str(int(num("num_slots"))), ",".join(sorted(running)), ",".join(sorted(waiting))
        ).set(self.wall_clock())

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
