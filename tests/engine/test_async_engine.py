"""The async front door: concurrent streams, deltas that add up, abort that frees blocks at once."""

from __future__ import annotations

import asyncio

import pytest

from base_engine import AsyncEngine, EngineConfig, EngineRequest, LLMEngine, SamplingParams
from tests.engine.conftest import random_prompts


@pytest.fixture
def async_engine(tiny_llama_dir):
    engine = AsyncEngine(LLMEngine(tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, block_size=4)))
    engine.start()
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, request: EngineRequest) -> tuple[list[int], str, object]:
    tokens: list[int] = []
    text = ""
    last = None
    async for out in engine.generate(request):
        tokens += out.new_token_ids
        text += out.new_text
        last = out
    return tokens, text, last


def test_concurrent_streams_match_offline(async_engine, tiny_llama_dir) -> None:
    prompts = random_prompts(4, 500, 3, 20, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main():
        reqs = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect(async_engine, r) for r in reqs))

    results = asyncio.run(main())
    offline = LLMEngine(tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, block_size=4))
    for i, (tokens, text, last) in enumerate(results):
        offline.add_request("x", prompts[i], params)
        final = None
        while offline.has_unfinished:
            for out in offline.step():
                final = out
        assert tokens == last.token_ids == final.token_ids
        assert text == last.text == final.text
        assert last.finish_reason == "length" and last.metrics.ttft_s >= 0


def test_cancel_aborts_and_frees_blocks(async_engine) -> None:
    prompt = random_prompts(1, 500, 30, 30, seed=22)[0]
    finished = []
    async_engine.on_finished.append(finished.append)

    async def main():
        stream = async_engine.generate(
            EngineRequest("long", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
        )
        async for out in stream:
            if len(out.token_ids) >= 3:
                break
        await stream.aclose()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if finished:
                break

    asyncio.run(main())
    assert [f.finish_reason for f in finished] == ["abort"]
    assert async_engine.engine.block_manager.num_used_blocks == 0
    assert not async_engine.engine.requests


def test_validation_error_before_streaming(async_engine) -> None:
    async def main():
        async for _ in async_engine.generate(EngineRequest("bad", [], SamplingParams())):
            pass

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())
