"""`vllm:iteration_tokens_total`: the engine counts every step's tokens in vLLM's buckets, and /metrics
shows its histogram as vLLM names it (`..._total_bucket`, `_count`, `_sum`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from api.metrics.prometheus import Metrics
from base_engine import LLM, SamplingParams
from base_engine.outputs import ITERATION_TOKEN_BUCKETS
from tests.harness.engine_inputs import random_prompts


def test_every_step_is_counted_with_its_tokens(tiny_llama_dir) -> None:
    prompts = random_prompts(5, 500, 3, 40, seed=11)
    with LLM(tiny_llama_dir, num_kv_blocks=128, block_size=4, max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        stats = llm.engine.stats()
    assert sum(stats.iteration_token_counts) == stats.num_steps
    # No prefix hits among random prompts: each prompt token and each output token but the last is computed.
    assert stats.iteration_tokens_sum == sum(
        len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, outs, strict=True)
    )
    assert stats.iteration_token_counts[ITERATION_TOKEN_BUCKETS.index(32)] >= 1  # full chunked-prefill steps
    metrics = Metrics(model_name="m")
    metrics.update_engine(stats)
    text = metrics.render()[0].decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:iteration_tokens_total")
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("vllm:iteration_tokens_total_count", None)] == stats.num_steps
    assert samples[("vllm:iteration_tokens_total_sum", None)] == stats.iteration_tokens_sum
    assert samples[("vllm:iteration_tokens_total_bucket", "+Inf")] == stats.num_steps
    assert samples[("vllm:iteration_tokens_total_bucket", "1.0")] == stats.iteration_token_counts[0]
