"""The async front door: concurrent streams, deltas that add up, abort that frees blocks at once."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from base_engine import AsyncEngine, EngineConfig, EngineRequest, LLMEngine, SamplingParams
from tests.harness.engine_inputs import random_prompts


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


def test_stream_whose_event_loop_closed_is_aborted_and_the_engine_goes_on(async_engine) -> None:
    """A consumer's event loop that closed without ending its stream (nobody will ever read it): the
    request is aborted, and the engine thread does not die delivering to that loop."""
    prompt = random_prompts(1, 500, 8, 8, seed=23)[0]
    finished = []
    async_engine.on_finished.append(finished.append)
    loop = asyncio.new_event_loop()
    stream = async_engine.generate(
        EngineRequest("orphan", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    )
    assert loop.run_until_complete(stream.__anext__()).request_id == "orphan"
    loop.close()  # the stream is neither closed nor read again: no abort was ever asked for
    for _ in range(1000):
        if finished:
            break
        time.sleep(0.01)
    assert [(out.request_id, out.finish_reason) for out in finished] == [("orphan", "abort")]
    assert async_engine.is_healthy and async_engine.fatal_error is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens, _, last = asyncio.run(collect(async_engine, EngineRequest("after", prompt, params)))
    assert len(tokens) == 4 and last.finish_reason == "length"
    assert async_engine.engine.block_manager.num_used_blocks == 0
    assert not async_engine.engine.requests


def test_the_engine_thread_flushes_denormals(async_engine) -> None:
    """On the engine thread a subnormal operand reads as zero (DAZ) and a subnormal result is zero
    (FTZ): no step runs at denormal speed, whatever values an adapter brings."""
    subnormal = torch.tensor([1e-39], dtype=torch.float32)  # below finfo(float32).tiny ~1.18e-38

    def on_engine_thread(_: LLMEngine) -> tuple[float, float]:
        tiny = torch.tensor([torch.finfo(torch.float32).tiny], dtype=torch.float32)
        return float(subnormal * 1.0), float(tiny / 4)

    if not torch.set_flush_denormal(False):  # False: this CPU has no FTZ/DAZ flags to set
        pytest.skip("this CPU cannot flush denormals")
    assert async_engine.flushes_denormals
    assert float(subnormal * 1.0) != 0.0  # this (test) thread computes denormals as usual
    read, produced = asyncio.run(async_engine._call(on_engine_thread))
    assert read == 0.0 and produced == 0.0
