"""Speculative decoding's acceptance per adapter: counted by the engine (`EngineStats.spec_decode`,
keyed by the adapter name clients send, "" = base) and shown in `/metrics` with vLLM's names plus a
`lora_name` label; absent without speculation."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from api.metrics.prometheus import Metrics
from base_engine import LLM, SamplingParams
from base_engine.outputs import EngineStats, SpecDecodeCounts
from tests.harness.engine_inputs import random_prompts
from tests.harness.raw_adapters import write_adapter


def _stats(spec_decode: dict[str, SpecDecodeCounts]) -> EngineStats:
    return EngineStats(0, 0, 0, 1, 0, 0, 0, 0, spec_decode=spec_decode)


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_engine_counts_drafts_per_adapter(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "bot", seed=3)
    prompts = [p + p + p for p in random_prompts(4, 500, 6, 10, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(tiny_llama_dir, speculative="ngram", num_speculative_tokens=3, speculative_off_batch=0) as llm:
        llm.generate(prompts, params, adapters=[None, adapter, None, adapter])
        counts = llm.engine.stats().spec_decode
    assert set(counts) == {"", "bot"}
    for c in counts.values():
        assert c.num_drafts > 0 and c.num_draft_tokens >= c.num_drafts
        assert len(c.num_accepted_tokens_per_pos) == 3
        assert sum(c.num_accepted_tokens_per_pos) == c.num_accepted_tokens <= c.num_draft_tokens
        # accepted drafts are a prefix: position p+1 accepted only where p was
        pos = (c.num_drafts, *c.num_accepted_tokens_per_pos)
        assert all(a >= b for a, b in zip(pos, pos[1:], strict=False))
    with LLM(tiny_llama_dir) as llm:
        assert llm.engine.stats().spec_decode == {}


def test_metrics_carry_vllm_names_and_lora_name() -> None:
    metrics = Metrics(CollectorRegistry(), model_name="base")
    metrics.update_engine(_stats({}))
    assert not any(name.startswith("vllm:spec_decode") for name, _ in _samples(metrics))
    metrics.update_engine(
        _stats({"": SpecDecodeCounts(4, 12, 5, (3, 2, 0)), "bot": SpecDecodeCounts(2, 6, 1, (1, 0, 0))})
    )
    samples = _samples(metrics)
    base = (("engine", "0"), ("lora_name", ""), ("model_name", "base"))
    bot = (("engine", "0"), ("lora_name", "bot"), ("model_name", "base"))
    assert samples[("vllm:spec_decode_num_drafts_total", base)] == 4
    assert samples[("vllm:spec_decode_num_draft_tokens_total", base)] == 12
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", base)] == 5
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", bot)] == 1
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, tuple(sorted((*base, ("position", str(p))))))] for p in range(3)] == [3, 2, 0]
