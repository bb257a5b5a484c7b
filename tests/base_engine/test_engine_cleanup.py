"""What an engine holds beyond a step ends when its owner is done, and not before.

The adapter loader's thread pools end at `close` (`LLM`, `LLMEngine`, `AsyncEngine.close`), never at
`AsyncEngine.shutdown` (the engine is reused after an AsyncEngine stops); a shutdown that times out
while a step runs still lets that step's finals reach their streams.
"""

from __future__ import annotations

import asyncio
import threading

from base_engine import LLM, AsyncEngine, EngineConfig, EngineRequest, LLMEngine, SamplingParams


def _pools_shut(engine: LLMEngine) -> tuple[bool, bool]:
    loader = engine.lora.cache.loader
    return loader._parse_pool._shutdown, loader._fetch_pool._shutdown


def test_async_engine_shutdown_leaves_the_engine_usable_and_close_ends_its_pools(tiny_llama_dir) -> None:
    engine = LLMEngine(tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, block_size=4))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    async_engine.shutdown()
    assert _pools_shut(engine) == (False, False)
    async_engine.close()
    assert _pools_shut(engine) == (True, True)


def test_llm_closes_the_engine_it_owns(tiny_llama_dir) -> None:
    with LLM(tiny_llama_dir, num_kv_blocks=64) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2
        assert _pools_shut(llm.engine) == (False, False)
    assert _pools_shut(llm.engine) == (True, True)


def test_a_final_made_while_shutdown_waits_is_still_dispatched(tiny_llama_dir) -> None:
    """shutdown's join times out mid-step; the step then finishes its request: the final arrives."""
    engine = LLMEngine(tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, block_size=4))
    async_engine = AsyncEngine(engine)
    entered, gate = threading.Event(), threading.Event()
    real_execute = engine.runner.execute

    def slow_execute(batch, lora=None):
        entered.set()
        gate.wait(30)
        return real_execute(batch, lora)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    async_engine.start()

    async def main():
        async def collect():
            last = None
            request = EngineRequest("late", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
            async for out in async_engine.generate(request):
                last = out
            return last

        task = asyncio.create_task(collect())
        await asyncio.to_thread(entered.wait, 30)
        await asyncio.to_thread(async_engine.shutdown, 0.1)  # gives up waiting: the step still runs
        gate.set()
        return await asyncio.wait_for(task, 10)

    final = asyncio.run(main())
    assert final.finished and final.finish_reason == "length" and len(final.token_ids) == 1
    async_engine._thread.join(10)
    async_engine._dispatcher.join(10)
    assert not async_engine._thread.is_alive() and not async_engine._dispatcher.is_alive()
