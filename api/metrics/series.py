"""The Prometheus series `/metrics` shows: their names, help texts, labels and buckets, defined once.

Names, types and buckets follow vLLM's V1 engine (`vllm-project/vllm docs/design/metrics.md`,
`vllm/v1/metrics/loggers.py`, summarized in ../shared/reference/platform.md section 2.1), so existing
dashboards work: every vLLM metric carries a `model_name` label with the served base model's name and
vLLM's `engine` label (the engine core's index; one engine per process here, so always "0", as a
single-engine `vllm serve`), except `vllm:lora_requests_info`, which has neither in vLLM either.
The `loraserve_*` series cover the adapter cache and, in a registry of their own, tenants.

Separate from api/metrics/prometheus.py, which decides what to count when (requests finish, engine stats
arrive)
and renders: this is the catalogue, long and declarative, that dashboards depend on.

No `*_created` series: vLLM's dashboards never read them and they double a scrape's series
(`disable_created_metrics`, process-wide, at import).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

disable_created_metrics()

ENGINE = "0"  # vLLM's `engine` label: the engine core's index (`per_engine_labelvalues` in its loggers)
BASE_LABELS = ["model_name", "engine"]


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


class EngineTotal:
    """Feeds a Prometheus counter from a cumulative total read elsewhere (the engine's stats)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last: float | None = None

    def update(self, total: float) -> None:
        # A total below the last one means a new engine counting from 0: count all of it again.
        previous = 0.0 if self.last is None or total < self.last else self.last
        self.counter.inc(total - previous)
        self.last = total


class VllmSeries:
    """vLLM's series, each already labelled with the served model's name and the engine (except the few
    with more labels: `request_success`, `cache_config_info`, `lora_info`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        r, base = registry, BASE_LABELS

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, base, registry=r).labels(model_name, ENGINE)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, base, registry=r).labels(model_name, ENGINE)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, base, buckets=tuple(buckets), registry=r).labels(model_name, ENGINE)

        self.num_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = EngineTotal(
            counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        )
        self.prefix_queries = EngineTotal(
            counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        )
        self.prefix_hits = EngineTotal(counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens."))
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
            [
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "engine",
            ],
            registry=r,
        )
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (value: wall-clock time of the sample).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )


# Queue time per priority: fine below a second, where an urgent class under load should stay.
QUEUE_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class LoraserveSeries:
    """Our own series: the adapter cache per tier in `registry`, per-tenant counters in
    `tenant_registry` (rendered only on request: they name tenants)."""

    def __init__(self, registry: CollectorRegistry, tenant_registry: CollectorRegistry) -> None:
        r, tenants = registry, tenant_registry
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

        self.adapter_loads = EngineTotal(c("loraserve_adapter_loads", "Adapters loaded into host memory."))
        self.adapter_load_seconds = EngineTotal(
            c("loraserve_adapter_load_seconds", "Seconds spent loading adapters.")
        )
        self.adapter_load_failures = EngineTotal(
            c("loraserve_adapter_load_failures", "Adapter loads that failed.")
        )
        self.adapter_hits = EngineTotal(
            c("loraserve_adapter_cache_hits", "Activations finding the adapter in a slot.")
        )
        self.adapter_misses = EngineTotal(
            c("loraserve_adapter_cache_misses", "Activations copying it into a slot.")
        )
        evictions = c("loraserve_adapter_cache_evictions", "Adapters evicted from a cache tier.", ("tier",))
        self.gpu_evictions = EngineTotal(evictions.labels("gpu"))
        self.cpu_evictions = EngineTotal(evictions.labels("cpu"))
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
        self.queue_time_by_priority = Histogram(
            "loraserve_request_queue_time_seconds",
            "Time spent waiting before first scheduled, per priority class (lower = more urgent).",
            ["priority"],
            buckets=QUEUE_TIME_BUCKETS,
            registry=r,
        )


LORA_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0)  # fmt: skip


class ResidencySeries:
    """vLLM's adapter-residency series (vllm-project/vllm#54830), the ones llm-d's
    `lora-load-state-scorer` reads (llm-d-router#2792): which adapters this engine holds, where."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, base = registry, BASE_LABELS
        self.loaded = Gauge(
            "vllm:lora_adapter_loaded",
            "1 per resident LoRA adapter: level gpu (in a device slot) or cpu (host cache only).",
            [*base, "adapter_name", "level", "pinned", "rank"],
            registry=r,
        )
        self.num_gpu = Gauge(
            "vllm:num_gpu_loaded_lora_adapters", "LoRA adapters in GPU slots.", base, registry=r
        ).labels(model_name, ENGINE)
        self.num_cpu = Gauge(
            "vllm:num_cpu_loaded_lora_adapters", "LoRA adapters in the host cache.", base, registry=r
        ).labels(model_name, ENGINE)
        self.max_gpu = Gauge(
            "vllm:max_gpu_lora_adapters", "GPU LoRA adapter slots (max_loras).", base, registry=r
        ).labels(model_name, ENGINE)
        load_seconds = Histogram(
            "vllm:lora_adapter_load_seconds",
            "LoRA adapter transition times: load (into the host cache), activate (host -> GPU slot).",
            [*base, "transition"],
            buckets=LORA_LOAD_BUCKETS,
            registry=r,
        )
        self.load_seconds = load_seconds.labels(model_name, ENGINE, "load")
        self.activate_seconds = load_seconds.labels(model_name, ENGINE, "activate")
