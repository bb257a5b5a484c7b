"""The request path's collaborators, replaced by recording ones, in-process (FastAPI TestClient on a
real engine and SQLite registry).

Contract checked: `Quotas.admit` runs before any engine work and can refuse with 429; the release it
returns gets the request's usage; `Meter.begin` runs once admitted and `Meter.finish` once per
request with outputs whose `compute_usage` equals the `usage` the client received (streamed or not,
n > 1); `Meter.stop` runs at shutdown; the context carries the request id, key prefix and adapter.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.bootstrap import build_state
from api.context import RequestContext, Usage, compute_usage
from api.errors import APIError
from api.inference.inflight import InFlight
from api.metering.request_meter import NoMeter
from api.settings import Settings
from api.tenancy.quota_gate import NoQuotas, Release
from base_engine.outputs import RequestOutput


@pytest.fixture(scope="module")
def settings(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    data_dir = tmp_path_factory.mktemp("seams")
    return Settings(
        model=tiny_llama_dir, data_dir=data_dir, admin_key="lsa-seams", num_kv_blocks=64, max_model_len=128
    )


def test_hooks_see_what_the_client_sees(settings: Settings) -> None:
    state = build_state(settings)
    finished: list[tuple[RequestContext, Usage]] = []
    admitted: list[str] = []
    released: list[Usage | None] = []
    drained: list[bool] = []
    refuse: dict[str, bool] = {"now": False}

    class Quotas(NoQuotas):
        def admit(self, ctx: RequestContext) -> Release:
            if refuse["now"]:
                raise APIError(
                    429, "quota rpm exceeded", code="rate_limit_exceeded", headers={"Retry-After": "2"}
                )
            assert ctx.estimated_tokens == ctx.num_prompt_tokens + ctx.max_new_tokens > 0
            return released.append

    class Meter(NoMeter):
        def begin(self, ctx: RequestContext) -> None:
            admitted.append(ctx.request_id)

        def finish(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
            finished.append((ctx, compute_usage(finals, n=ctx.n)))

        def stop(self) -> None:
            drained.append(True)

    state.inference.meter.stop()  # the server's own, replaced below
    meter = Meter()
    state.inference = dataclasses.replace(
        state.inference,
        quotas=Quotas(),
        meter=meter,
        inflight=InFlight(meter=meter, metrics=state.metrics),
    )
    with TestClient(create_app(state)) as client:
        tenant = client.post(
            "/admin/api/tenants", json={"name": "seams"}, headers={"Authorization": "Bearer lsa-seams"}
        ).json()
        auth = {"Authorization": f"Bearer {tenant['api_key']}"}
        body = {"model": state.model_name, "prompt": "Hello there", "max_tokens": 5, "n": 2, "seed": 1}
        r = client.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        ctx, usage = finished[-1]
        assert usage.to_dict() == r.json()["usage"] and usage.completion_tokens == 10
        assert ctx.request_id == r.json()["id"] == r.headers["x-request-id"] == admitted[-1]
        assert ctx.key_prefix == tenant["api_key"].split("-")[1] and ctx.adapter_name is None
        assert ctx.engine_request_ids == [f"{ctx.request_id}-0", f"{ctx.request_id}-1"]
        assert released[-1] == usage

        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=stream_body, headers=auth) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed_usage = json.loads(events[-2])["usage"]
        assert finished[-1][1].to_dict() == streamed_usage and released[-1] == finished[-1][1]

        refuse["now"] = True
        count = len(finished)
        r = client.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.headers["x-request-id"].startswith("cmpl-")
        assert len(finished) == count and r.headers["x-request-id"] not in admitted
    assert drained == [True]
