"""The metering hooks in-process, on a real engine and SQLite registry: the paths a server test cannot
time (a client gone before its stream started, a request the engine refused after admission) are
still billed exactly once, and the record merges n choices the way the response's usage does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from api.context import Caller, RequestContext
from api.inference.planning import GenerationPlan, plan_generation
from api.inference.protocol import CompletionRequest
from api.inference.running import abandon_unstarted
from api.metering.request_meter import usage_record
from api.settings import Settings
from api.state import AppState
from api.tenancy.quota_gate import TenantQuotaGate, quota_error
from api.tenancy.quotas import QuotaExceededError
from base_engine.async_engine import EngineRequest
from base_engine.outputs import RequestMetrics, RequestOutput
from base_engine.sampling_params import SamplingParams
from registry.usage import UsageRecord, export_usage
from tests.harness.callers import new_caller
from tests.harness.in_process import admit_plan, collect_plan, in_process_state, request_meter


@pytest.fixture(scope="module")
def state(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppState]:
    data_dir = tmp_path_factory.mktemp("wiring")
    settings = Settings(
        model=tiny_llama_dir, data_dir=data_dir, admin_key="lsa-w", num_kv_blocks=64, max_model_len=128
    )
    with in_process_state(settings, start_engine=False) as state:
        yield state


@pytest.fixture(scope="module")
def caller(state: AppState) -> Caller:
    return new_caller(state, "wiring")


def records(state: AppState, tenant_id: str) -> dict[str, UsageRecord]:
    meter = request_meter(state)
    meter.flush()
    with state.sessions() as session:
        return {r.request_id: r for r in export_usage(session, tenant_id=tenant_id, limit=10_000).records}


def test_admitted_request_whose_stream_never_started_is_billed_once(state: AppState, caller: Caller) -> None:
    body = CompletionRequest(model=state.model_name, prompt="Hello there", max_tokens=3, n=2)
    with state.sessions() as session:
        plan = plan_generation(
            inference=state.inference, session=session, caller=caller, body=body, kind="completion"
        )
    ctx = plan.ctx
    meter, quotas = request_meter(state), state.inference.quotas
    assert isinstance(quotas, TenantQuotaGate)
    ticket = admit_plan(state, plan)
    assert meter.in_flight(ctx.request_id, tenant_id=ctx.tenant_id) is not None
    abandon_unstarted(
        inflight=state.inference.inflight, plan=plan
    )  # what the response does when it closes without being iterated
    abandon_unstarted(inflight=state.inference.inflight, plan=plan)
    ticket.release(ctx.usage)
    assert meter.in_flight(ctx.request_id, tenant_id=ctx.tenant_id) is None
    assert quotas.limiter.num_concurrent(caller.tenant.id) == 0 and state.admission.num_in_flight == 0
    record = records(state, caller.tenant.id)[ctx.request_id]
    assert (record.finish_reason, record.completion_tokens) == ("abort", 0)
    assert record.prompt_tokens == ctx.num_prompt_tokens  # the prompt once, although n = 2


def test_request_refused_by_the_engine_after_admission_is_billed_once(
    state: AppState, caller: Caller
) -> None:
    # Longer than max_model_len: plan_generation would refuse it; built by hand, it reaches the engine.
    prompt = list(range(3, 3 + 200))
    ctx = RequestContext(
        request_id="cmpl-refused-by-engine", kind="completion", tenant_id=caller.tenant.id,
        tenant_name=caller.tenant.name, key_prefix=caller.key_prefix, model=state.model_name,
        num_prompt_tokens=len(prompt), engine_request_ids=["cmpl-refused-by-engine"],
    )  # fmt: skip
    request = EngineRequest(ctx.request_id, prompt, SamplingParams(max_tokens=4), tenant_id=caller.tenant.id)
    plan = GenerationPlan(ctx, [request], stream=False, include_usage=False, num_top_logprobs=None)
    finals = asyncio.run(collect_plan(state, plan))
    assert [o.finish_reason for o in finals] == ["error"]
    record = records(state, caller.tenant.id)[ctx.request_id]
    assert (record.finish_reason, record.prompt_tokens, record.completion_tokens) == ("error", 200, 0)


def _out(rid: str, *, completion: int, reason: str, cached: int = 0, queue: float = 0.5) -> RequestOutput:
    ttft = queue + 0.1
    metrics = RequestMetrics(queue_time_s=queue, prefill_time_s=0.1, ttft_s=ttft, e2e_s=ttft + completion)
    return RequestOutput(
        rid, [1] * 10, [7] * completion, "", finish_reason=reason, num_cached_tokens=cached, metrics=metrics
    )


@pytest.mark.parametrize(
    ("reasons", "expected"),
    [(("stop", "stop"), "stop"), (("stop", "length"), "length"), (("length", "abort"), "abort"),
     (("abort", "error"), "error")],
)  # fmt: skip
def test_record_merges_choices_like_the_response_usage(reasons: tuple[str, str], expected: str) -> None:
    created = datetime(2026, 11, 29, 10, tzinfo=UTC)
    ctx = RequestContext(
        request_id="r", kind="chat", tenant_id="t", tenant_name="t", key_prefix="k", model="bot",
        adapter_name="bot", adapter_version=2, n=2, created_at=created,
    )  # fmt: skip
    finals = [
        _out("r-0", completion=0 if reasons[0] == "abort" else 4, reason=reasons[0], cached=3, queue=0.7),
        _out("r-1", completion=5, reason=reasons[1], cached=8, queue=0.2),
    ]
    record = usage_record(ctx, finals, finished_at=created + timedelta(seconds=3))
    assert record.finish_reason == expected
    assert (record.prompt_tokens, record.cached_prompt_tokens) == (10, 3)  # the prompt of the first choice
    assert record.completion_tokens == sum(len(o.token_ids) for o in finals)
    assert record.queue_time_s == 0.2 and record.total_time_s == 3.0
    produced = [o.metrics.ttft_s for o in finals if o.token_ids and o.metrics]
    assert record.ttft_s == min(produced)
    assert (record.adapter_name, record.adapter_version, record.key_prefix) == ("bot", 2, "k")


def test_quota_errors_carry_retry_headers() -> None:
    soon = quota_error(QuotaExceededError("rpm", 0.2, "Rate limit reached for requests per minute (rpm)"))
    assert soon.status == 429 and soon.code == "rate_limit_exceeded" and soon.param == "rpm"
    assert soon.headers == {"Retry-After": "1", "retry-after-ms": "200"}
    never = quota_error(QuotaExceededError("tpm", 60.0, "too large", is_retryable=False))
    assert never.code == "insufficient_quota" and never.headers["x-should-retry"] == "false"
