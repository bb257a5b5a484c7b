"""The request path in process, on a real engine and SQLite registry: for the tests that drive
planning, admission and running directly (what a server test cannot time: a disconnect at a given
output, a refusal after admission)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from api.bootstrap import build_state
from api.inference.planning import GenerationPlan
from api.inference.running import collect
from api.metering.request_meter import RequestMeter
from api.settings import Settings
from api.state import AppState
from api.tenancy.admission import Ticket, admit
from base_engine.outputs import RequestOutput


@contextmanager
def in_process_state(settings: Settings, *, start_engine: bool) -> Iterator[AppState]:
    """`build_state(settings)`; with `start_engine`, the engine thread runs and ends requests through
    the in-flight table, as the app's lifespan wires it."""
    state = build_state(settings)
    if start_engine:
        state.engine.on_finished.append(state.inference.inflight.on_engine_finished)
        state.engine.start()
    try:
        yield state
    finally:
        if start_engine:
            state.engine.shutdown()
        state.inference.meter.stop()


def request_meter(state: AppState) -> RequestMeter:
    meter = state.inference.meter
    assert isinstance(meter, RequestMeter)
    return meter


def admit_plan(state: AppState, plan: GenerationPlan) -> Ticket:
    inference = state.inference
    return admit(
        quotas=inference.quotas,
        admission=inference.admission,
        meter=inference.meter,
        ctx=plan.ctx,
        num_requests=len(plan.requests),
    )


async def collect_plan(state: AppState, plan: GenerationPlan) -> list[RequestOutput]:
    inference = state.inference
    return await collect(
        engine=inference.engine, inflight=inference.inflight, timeout_s=inference.request_timeout_s, plan=plan
    )
