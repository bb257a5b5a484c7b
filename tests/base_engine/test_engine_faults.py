"""The engine thread survives anything a request does, and never waits on an observer's I/O.

Faults are injected at each point a request reaches the engine thread: a queued command (abort, add,
any call), idle housekeeping, an adapter failure, the model step (once, and every time), and a slow
`on_finished` observer (metering's journal under a slow fsync).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from base_engine import AsyncEngine, EngineConfig, EngineRequest, LLMEngine, SamplingParams
from base_engine.async_engine import MAX_CONSECUTIVE_FAILURES
from tests.harness.wait import wait_for

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir):
    engine = AsyncEngine(LLMEngine(tiny_llama_dir, config=EngineConfig(num_kv_blocks=64, block_size=4)))
    engine.start()
    yield engine
    engine.shutdown()


async def _run(engine: AsyncEngine, rid: str, prompt: list[int] | None = None, params=PARAMS):
    async def collect():
        last = None
        async for out in engine.generate(EngineRequest(rid, prompt or [5, 6, 7, 8], params)):
            last = out
        return last

    return await asyncio.wait_for(collect(), 30)  # a dead engine thread would hang it forever


def test_failing_commands_do_not_stop_the_engine(engine, monkeypatch) -> None:
    real_abort = engine.engine.abort

    def broken_abort(request_id: str):
        raise RuntimeError("injected abort failure")

    monkeypatch.setattr(engine.engine, "abort", broken_abort)
    engine.abort("nobody")  # raises on the engine thread
    engine._submit(lambda: 1 / 0)  # any queued command that raises
    monkeypatch.setattr(engine.engine, "abort", real_abort)
    out = asyncio.run(_run(engine, "after"))
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert engine.is_healthy


def test_failing_idle_housekeeping_does_not_stop_the_engine(engine, monkeypatch, caplog) -> None:
    calls = []

    def broken_housekeeping() -> None:
        calls.append(1)
        raise OSError("injected: the disk tier is unreadable")

    monkeypatch.setattr(engine.engine.lora, "housekeeping", broken_housekeeping)
    wait_for(
        lambda: len(calls) >= 3, 10.0, interval=0.01
    )  # the idle loop ran it (and failed) again and again
    assert engine.is_healthy and engine.fatal_error is None
    assert caplog.text.count("adapter housekeeping failed while idle") == 1  # logged once, not per try
    monkeypatch.undo()
    out = asyncio.run(_run(engine, "after"))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_failing_add_fails_only_that_request(engine, monkeypatch) -> None:
    real_add = engine.engine.add_request

    def add(request_id, *args, **kwargs):
        if request_id == "bad":
            raise RuntimeError("injected add failure")
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "add_request", add)

    async def main():
        return await asyncio.gather(_run(engine, "bad"), _run(engine, "good"))

    bad, good = asyncio.run(main())
    assert bad.finish_reason == "error" and "injected add failure" in bad.error
    assert good.finish_reason == "length"


def test_step_failure_fails_that_step_only_and_the_engine_goes_on(engine, monkeypatch) -> None:
    runner = engine.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def execute(batch, lora=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected model failure")
        return real_execute(batch, lora)

    monkeypatch.setattr(runner, "execute", execute)
    first = asyncio.run(_run(engine, "victim"))
    assert first.finish_reason == "error" and "injected model failure" in first.error
    second = asyncio.run(_run(engine, "next"))
    assert second.finish_reason == "length"
    assert engine.is_healthy and engine.engine.block_manager.num_used_blocks == 0


def test_a_step_that_always_fails_turns_unhealthy_and_ends_every_request(engine, monkeypatch) -> None:
    def execute(batch, lora=None):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine.runner, "execute", execute)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(_run(engine, f"r{i}") for i in range(3))), 30)

    outs = asyncio.run(main())
    assert all(o.finish_reason == "error" and "device lost" in o.error for o in outs)
    wait_for(lambda: engine.num_consecutive_failures >= 1, 10.0, interval=0.01)
    # Keep failing: three in a row make it unhealthy (what /health and /ready report).
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        asyncio.run(main())
    assert not engine.is_healthy and not engine.is_running
    monkeypatch.undo()
    out = asyncio.run(_run(engine, "recovered"))
    assert out.finish_reason == "length" and engine.is_healthy


def test_adapter_failure_fails_only_its_request(engine, tmp_path) -> None:
    from adapters.types import AdapterRef

    missing = AdapterRef(id="t/missing@1", sha256="0" * 64, source=str(tmp_path / "nowhere"), name="missing")

    async def main():
        bad = EngineRequest("bad", [5, 6, 7], PARAMS, adapter=missing)

        async def run_bad():
            last = None
            async for out in engine.generate(bad):
                last = out
            return last

        return await asyncio.gather(run_bad(), _run(engine, "good"))

    bad, good = asyncio.run(main())
    assert bad.finish_reason == "error" and good.finish_reason == "length"
    assert engine.is_healthy


def test_blocked_observer_never_blocks_the_engine_thread(engine) -> None:
    """An observer stuck on I/O (e.g. metering under a slow fsync) holds only the finals behind it:
    another stream still gets every token, and each final arrives after its observers ran."""
    entered, gate = threading.Event(), threading.Event()
    observed: list[str] = []

    def stuck(out) -> None:
        entered.set()
        gate.wait(30)
        observed.append(out.request_id)

    engine.on_finished.append(stuck)
    long_params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        short = asyncio.create_task(_run(engine, "short", [20, 21, 22], SamplingParams(max_tokens=1)))
        await asyncio.to_thread(entered.wait, 30)  # the observer now blocks the dispatcher
        tokens: list[int] = []
        final = None
        async for out in engine.generate(EngineRequest("long", [9, 10, 11], long_params)):
            tokens += out.new_token_ids
            if len(tokens) == 39:  # every token but the last streamed while the observer was stuck
                assert not short.done() and observed == []
                gate.set()
            final = out
        return await short, final

    short, final = asyncio.run(asyncio.wait_for(main(), 60))
    assert short.finish_reason == final.finish_reason == "length" and len(final.token_ids) == 40
    assert observed == ["short", "long"]


def _finish_two_in_one_step(engine: AsyncEngine) -> tuple:
    """Two one-token requests, both added before the step that finishes them both."""
    gate = threading.Event()
    engine._submit(lambda: gate.wait(30))  # hold the engine thread until both adds are queued behind

    async def main():
        one_token = SamplingParams(max_tokens=1, ignore_eos=True)
        first = asyncio.create_task(_run(engine, "first", [5, 6, 7], one_token))
        second = asyncio.create_task(_run(engine, "second", [8, 9, 10], one_token))
        await asyncio.sleep(0.2)  # both generators have queued their adds
        gate.set()
        return await asyncio.wait_for(asyncio.gather(first, second), 20)

    return asyncio.run(main())


def _raise_on_second_call(real):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure after a finish")
        return real(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("where", ["finish_output", "detokenizer_update"])
def test_a_step_raising_after_a_finish_still_delivers_that_final(engine, monkeypatch, where) -> None:
    """The first request's final, made before the step raised, arrives; the second ends failed."""
    import base_engine.engine as engine_module
    from base_engine.detokenizer import Detokenizer

    if where == "finish_output":  # raises after the request left the engine's table
        broken = _raise_on_second_call(engine_module.finish_output)
        monkeypatch.setattr(engine_module, "finish_output", broken)
    else:  # raises before its finish: the request is still in the engine
        monkeypatch.setattr(Detokenizer, "update", _raise_on_second_call(Detokenizer.update))
    first, second = _finish_two_in_one_step(engine)
    assert first.finish_reason == "length" and len(first.token_ids) == 1
    assert second.finish_reason == "error" and "injected failure after a finish" in second.error
    assert engine.num_in_flight == 0 and engine.is_healthy
    monkeypatch.undo()
    assert asyncio.run(_run(engine, "after")).finish_reason == "length"
