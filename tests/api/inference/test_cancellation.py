"""A consumer that goes away (client disconnect, closed stream) ends its engine requests at once,
whatever moment the cancel lands at: here, the worst one, while an output is being handed over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from api.context import Caller
from api.inference.planning import GenerationPlan, plan_generation
from api.inference.protocol import CompletionRequest
from api.settings import Settings
from api.state import AppState
from base_engine.async_engine import EngineRequest
from base_engine.outputs import RequestOutput
from registry.usage import export_usage
from tests.harness.callers import new_caller
from tests.harness.in_process import admit_plan, collect_plan, in_process_state, request_meter
from tests.harness.wait import wait_for

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def state(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppState]:
    settings = Settings(
        model=tiny_llama_dir,
        data_dir=tmp_path_factory.mktemp("cancel"),
        admin_key="lsa-c",
        num_kv_blocks=64,
        max_model_len=256,
    )
    with in_process_state(settings, start_engine=True) as state:
        yield state


@pytest.fixture(scope="module")
def caller(state: AppState) -> Caller:
    return new_caller(state, "cancel")


def _plan(state: AppState, caller: Caller) -> GenerationPlan:
    body = CompletionRequest(model=state.model_name, prompt="Hello", max_tokens=MAX_TOKENS, ignore_eos=True)
    with state.sessions() as session:
        return plan_generation(
            inference=state.inference, session=session, caller=caller, body=body, kind="completion"
        )


async def _cancel_during_handover(state: AppState, plan: GenerationPlan, after: int) -> None:
    """Runs `collect` and cancels it just as its queue receives output number `after`: the item is in
    the consumer's hands but the consumer has not resumed yet."""
    engine_generate = state.engine.generate
    consumer: asyncio.Task[list[RequestOutput]] | None = None

    async def handover_then_cancel(request: EngineRequest) -> AsyncIterator[RequestOutput]:
        seen = 0
        async for out in engine_generate(request):
            yield out  # the caller puts it in the consumer's queue before asking for the next one
            seen += 1
            if seen == after:
                await asyncio.sleep(0)
                assert consumer is not None
                consumer.cancel()

    state.engine.generate = handover_then_cancel  # type: ignore[method-assign]
    try:
        consumer = asyncio.create_task(collect_plan(state, plan))
        with pytest.raises(asyncio.CancelledError):
            await consumer
    finally:
        del state.engine.generate  # back to the class's method


@pytest.mark.parametrize("after", [1, 3, 10])
def test_cancel_landing_as_an_output_is_handed_over_aborts_the_request(
    state: AppState, caller: Caller, after: int
) -> None:
    plan = _plan(state, caller)
    ticket = admit_plan(state, plan)
    try:
        asyncio.run(_cancel_during_handover(state, plan, after))
    finally:
        ticket.release(plan.ctx.usage)
    meter = request_meter(state)  # the engine thread ends the request
    wait_for(
        lambda: meter.in_flight(plan.ctx.request_id, tenant_id=plan.ctx.tenant_id) is None,
        30,
        interval=0.01,
        what="the request ends",
    )
    meter.flush()
    with state.sessions() as session:
        usage = export_usage(session, tenant_id=caller.tenant.id, limit=10_000).records
    record = next(r for r in usage if r.request_id == plan.ctx.request_id)
    # Without the abort the request ran on to MAX_TOKENS ("length") although nobody was reading it.
    assert record.finish_reason == "abort"
    assert after <= record.completion_tokens < MAX_TOKENS
    assert state.engine.is_healthy and state.engine.fatal_error is None
    assert state.engine.engine.block_manager.num_used_blocks == 0 and not state.engine.engine.requests
