"""A request cut off before its usage was known (the client left) gives its tenant's `tpm` back down
to what it was billed: the quota is released from the request's end in the engine, with the usage
metering bills, not from the response (which never learnt the usage). In process on a real engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from api.context import Caller
from api.inference import completions
from api.inference.planning import plan_generation
from api.inference.protocol import CompletionRequest
from api.metering.request_meter import RequestMeter
from api.settings import Settings
from api.state import AppState
from api.tenancy.quota_gate import TenantQuotaGate
from base_engine.async_engine import EngineRequest
from base_engine.outputs import RequestOutput
from registry.usage import export_usage
from tests.harness.callers import new_caller
from tests.harness.in_process import admit_plan, in_process_state

TPM = 100_000
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def state(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppState]:
    settings = Settings(
        model=tiny_llama_dir,
        data_dir=tmp_path_factory.mktemp("quota-release"),
        admin_key="lsa-q",
        num_kv_blocks=64,
        max_model_len=256,
        default_tpm=TPM,
    )
    with in_process_state(settings, start_engine=True) as state:
        yield state


def _disconnecting_request(after_outputs: asyncio.Event) -> Request:
    """An ASGI request whose client goes away once `after_outputs` is set."""

    async def receive() -> dict[str, Any]:
        await after_outputs.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)


async def _answer_until_disconnect(state: AppState, caller: Caller) -> str:
    body = CompletionRequest(model=state.model_name, prompt="Hello", max_tokens=MAX_TOKENS, ignore_eos=True)
    with state.sessions() as session:
        plan = plan_generation(
            inference=state.inference, session=session, caller=caller, body=body, kind="completion"
        )
    ticket = admit_plan(state, plan)
    some_outputs = asyncio.Event()
    engine_generate = state.engine.generate

    async def generate(request: EngineRequest) -> AsyncIterator[RequestOutput]:
        seen = 0
        async for out in engine_generate(request):
            yield out
            seen += 1
            if seen == 3:
                some_outputs.set()

    state.engine.generate = generate  # type: ignore[method-assign]
    try:
        response = await completions._answer(
            inference=state.inference,
            request=_disconnecting_request(some_outputs),
            plan=plan,
            ticket=ticket,
            headers={},
        )
    finally:
        del state.engine.generate  # back to the class's method
    assert response.status_code == 499
    assert plan.ctx.usage is None  # the response never learnt what the request used
    return plan.ctx.request_id


def test_a_request_cut_off_by_a_disconnect_is_charged_what_it_is_billed(state: AppState) -> None:
    caller = new_caller(state, "quota-release")
    quotas = state.inference.quotas
    assert isinstance(quotas, TenantQuotaGate)
    quotas.limiter.clock = lambda: 1000.0  # no refill: the bucket shows exactly what was charged
    tenant_id = caller.tenant.id

    def remaining() -> int:
        return int(quotas.limiter.headers(tenant_id, None)["x-ratelimit-remaining-tokens"])

    assert remaining() == TPM
    request_id = asyncio.run(_answer_until_disconnect(state, caller))
    meter = state.inference.meter
    assert isinstance(meter, RequestMeter)
    deadline = time.monotonic() + 30
    while meter.in_flight(request_id, tenant_id=tenant_id) is not None or quotas.limiter.num_concurrent(
        tenant_id
    ):
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.01)
    meter.flush()
    with state.sessions() as session:
        records = export_usage(session, tenant_id=tenant_id, limit=100).records
    record = next(r for r in records if r.request_id == request_id)
    assert record.finish_reason == "abort" and 3 <= record.completion_tokens < MAX_TOKENS
    # Without the release at the request's end, the whole estimate (prompt + 120) stayed charged.
    assert remaining() == TPM - (record.prompt_tokens + record.completion_tokens)
