"""The metric families a scrape of /metrics must carry: vLLM's names (so vLLM dashboards work) and ours
for the adapter cache and tenants."""

REQUIRED_METRIC_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:lora_requests_info",
    "loraserve_adapter_cache_adapters", "loraserve_adapter_cache_bytes", "loraserve_adapter_loads",
    "loraserve_adapter_load_seconds", "loraserve_adapter_cache_hits", "loraserve_adapter_cache_misses",
    "loraserve_adapter_cache_evictions", "loraserve_tenant_requests", "loraserve_tenant_prompt_tokens",
    "loraserve_tenant_generation_tokens",
    "vllm:lora_adapter_loaded", "vllm:num_gpu_loaded_lora_adapters", "vllm:num_cpu_loaded_lora_adapters",
    "vllm:max_gpu_lora_adapters", "vllm:lora_adapter_load_seconds", "loraserve_request_queue_time_seconds",
]  # fmt: skip
