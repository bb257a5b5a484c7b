"""Two small request-path rules: `max_completion_tokens` is honoured as given (0 is a 400 naming it, as
`max_tokens=0` is, never "absent"), and a request the engine's own validation refuses after admission
is metered off the event loop, where every other request's end is metered."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.context import RequestContext
from api.errors import APIError
from api.inference.planning import GenerationPlan
from api.inference.protocol import ChatCompletionRequest
from api.inference.sampling import sampling_params
from api.settings import Settings
from api.state import AppState
from base_engine.async_engine import EngineRequest
from base_engine.outputs import RequestOutput
from base_engine.sampling_params import SamplingParams
from tests.harness.callers import new_caller
from tests.harness.in_process import collect_plan, in_process_state


def _chat(**fields: object) -> ChatCompletionRequest:
    # As a body that got past the protocol's checks (model_construct skips them): the rule must hold
    # in the sampling step itself, where `max_completion_tokens` and `max_tokens` are combined.
    return ChatCompletionRequest.model_construct(
        model="m", messages=[{"role": "user", "content": "hi"}], **fields
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_zero_max_completion_tokens_is_refused_like_zero_max_tokens(
    fields: dict[str, int], param: str
) -> None:
    with pytest.raises(APIError) as info:
        sampling_params(_chat(**fields), num_prompt=3, max_model_len=64, index=0)
    assert (info.value.status, info.value.param) == (400, param)
    assert param in str(info.value)


def test_max_completion_tokens_wins_when_given() -> None:
    params = sampling_params(
        _chat(max_completion_tokens=2, max_tokens=5), num_prompt=3, max_model_len=64, index=0
    )
    assert params.max_tokens == 2


@pytest.fixture(scope="module")
def state(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppState]:
    settings = Settings(
        model=tiny_llama_dir,
        data_dir=tmp_path_factory.mktemp("refusal"),
        admin_key="lsa-r",
        num_kv_blocks=64,
        max_model_len=128,
    )
    with in_process_state(settings, start_engine=False) as state:
        yield state


def test_a_request_the_engine_refuses_is_metered_off_the_event_loop(
    state: AppState, monkeypatch: pytest.MonkeyPatch
) -> None:
    caller = new_caller(state, "refusal")
    prompt = list(range(3, 3 + 200))  # longer than max_model_len: the engine's validation refuses it
    ctx = RequestContext(
        request_id="cmpl-refused-off-loop", kind="completion", tenant_id=caller.tenant.id,
        tenant_name=caller.tenant.name, key_prefix=caller.key_prefix, model=state.model_name,
        num_prompt_tokens=len(prompt), engine_request_ids=["cmpl-refused-off-loop"],
    )  # fmt: skip
    request = EngineRequest(ctx.request_id, prompt, SamplingParams(max_tokens=4), tenant_id=caller.tenant.id)
    plan = GenerationPlan(ctx, [request], stream=False, include_usage=False, num_top_logprobs=None)
    meter = state.inference.meter
    finished_on: list[threading.Thread] = []
    real_finish = meter.finish

    def finish(ctx: RequestContext, finals: list[RequestOutput]) -> None:
        finished_on.append(threading.current_thread())
        real_finish(ctx, finals)

    monkeypatch.setattr(meter, "finish", finish)

    async def run() -> tuple[list[RequestOutput], threading.Thread]:
        return await collect_plan(state, plan), threading.current_thread()

    finals, loop_thread = asyncio.run(run())
    assert [o.finish_reason for o in finals] == ["error"]
    assert len(finished_on) == 1 and finished_on[0] is not loop_thread
