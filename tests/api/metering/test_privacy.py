"""What the server shows and leaves behind about its tenants.

- `/metrics` (unauthenticated) names no tenant by default: no per-tenant series, and
  `vllm:lora_requests_info` names adapters as clients send them in `model` (vLLM's convention), never
  `<tenant id>/<adapter>@<version>`; the per-tenant series come with the metrics token (or the admin
  key) or when the operator opts in (`LORASERVE_METRICS_TENANT_LABELS`).
- Data files (database, journal, keys) are 0600 and directories 0700, even under a umask of 022.
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.metering.meter import UsageMeter
from api.metrics.prometheus import Metrics
from api.state import AppState
from base_engine.outputs import AdapterCacheStats, AdapterRequests, EngineStats, RequestMetrics, RequestOutput
from tests.api.admin import console_helpers as ch
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, bearer, main_server_args
from tests.harness.uploads import files_of, peft_adapter, upload

TENANT_SERIES = "loraserve_tenant_"


def _finished(rid: str) -> RequestOutput:
    metrics = RequestMetrics(queue_time_s=0.01, prefill_time_s=0.01, ttft_s=0.02, e2e_s=0.1)
    return RequestOutput(rid, [1, 2, 3], [4, 5], "", finish_reason="stop", metrics=metrics)


def _stats(per_adapter: dict[str, AdapterRequests]) -> EngineStats:
    return EngineStats(
        num_running=1, num_waiting=1, num_kv_blocks_used=1, num_kv_blocks_total=10, num_preemptions=0,
        num_prefix_queries=0, num_prefix_hits=0, num_steps=1,
        adapters=AdapterCacheStats(num_slots=2, per_adapter=per_adapter),
    )  # fmt: skip


def test_metrics_name_no_tenant_unless_asked() -> None:
    tenant_id = uuid.uuid4().hex
    per_adapter = {f"{tenant_id}/support-bot@2": AdapterRequests(running=1, waiting=0)}
    per_adapter[f"{uuid.uuid4().hex}/sql@1"] = AdapterRequests(running=0, waiting=2)
    for tenant_labels in (False, True):
        metrics = Metrics(model_name="m", tenant_labels=tenant_labels)
        metrics.observe_finished(_finished("a"), tenant="acme-corp", adapter="support-bot@2")
        metrics.update_engine(_stats(per_adapter))
        public = metrics.render()[0].decode()
        assert TENANT_SERIES not in public and "acme-corp" not in public
        info = next(f for f in text_string_to_metric_families(public) if f.name == "vllm:lora_requests_info")
        labels = info.samples[0].labels
        if tenant_labels:  # the operator opted in: the engine's full ids
            assert labels["running_lora_adapters"] == f"{tenant_id}/support-bot@2"
        else:
            assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == (
                "support-bot",
                "sql",
            )
            assert tenant_id not in public
        private = metrics.render(include_tenants=True)[0].decode()
        assert 'loraserve_tenant_requests_total{tenant="acme-corp"} 1.0' in private
        assert {f.name for f in text_string_to_metric_families(private)} >= {"loraserve_tenant_requests"}


@pytest.fixture(scope="module")
def tenant(app_state: tuple[FastAPI, AppState]) -> dict[str, Any]:
    client = TestClient(app_state[0], base_url=ch.BASE_URL)
    name = f"private-{uuid.uuid4().hex[:8]}"
    created = ch.admin_api(app_state[0], "POST", "/tenants", json={"name": name})
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
    r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {created['api_key']}"})
    assert r.status_code == 200, r.text
    return created


def _wait_for_series(client: TestClient, name: str, headers: dict[str, str]) -> str:
    deadline = time.monotonic() + 10
    while True:  # the request is counted when the engine reports it finished
        text = client.get("/metrics", headers=headers).text
        if f'tenant="{name}"' in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_metrics_route_shows_tenants_only_with_a_key_or_opt_in(
    app_state: tuple[FastAPI, AppState], tenant: dict[str, Any]
) -> None:
    app, state = app_state
    client = TestClient(app, base_url=ch.BASE_URL)
    admin = {"Authorization": f"Bearer {ch.ADMIN}"}
    assert f'tenant="{tenant["name"]}"' in _wait_for_series(client, tenant["name"], admin)
    public = client.get("/metrics")
    assert public.status_code == 200
    assert (
        TENANT_SERIES not in public.text
        and tenant["name"] not in public.text
        and tenant["id"] not in public.text
    )
    wrong = client.get("/metrics", headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_metrics_token"
    state.settings.metrics_tenant_labels = True
    try:
        assert f'tenant="{tenant["name"]}"' in client.get("/metrics").text
    finally:
        state.settings.metrics_tenant_labels = False


def test_journal_is_created_private(
    sqlite_session: Any,
    tmp_path: Path,
) -> None:
    old = os.umask(0o022)
    try:
        meter = UsageMeter(sqlite_session, journal_path=tmp_path / "usage.journal")
        meter.start()
        meter.stop()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "usage.journal").stat().st_mode) == 0o600


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.slow
def test_real_server_keeps_its_files_private_and_its_metrics_anonymous(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)  # an existing, too open data dir is tightened
    env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY, "LORASERVE_METRICS_TOKEN": "scrape-token"}
    old = os.umask(0o022)  # what most shells and CI give a process
    try:
        process = ServerProcess(main_server_args(tiny_llama_dir), data_dir, env=env).start()
    finally:
        os.umask(old)
    try:
        base, server = process.base_url, Server(process, ADMIN_KEY, "sqlite-local")
        tenant_id, key = server.tenant("secretive")
        name = httpx.get(f"{base}/admin/api/tenants/{tenant_id}", headers=bearer(ADMIN_KEY)).json()["name"]
        assert (
            upload(server, key, "support-bot", files_of(peft_adapter(tmp_path / "adapter"))).status_code
            == 201
        )
        body = {"model": "support-bot", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            public = _lora_info_while_running(base)
            for _ in lines:
                pass
        assert public["running_lora_adapters"] == "support-bot", public  # as clients name it in `model`
        scrape = httpx.get(f"{base}/metrics", timeout=30).text
        assert tenant_id not in scrape and name not in scrape and TENANT_SERIES not in scrape
        token = {"Authorization": "Bearer scrape-token"}
        assert f'tenant="{name}"' in httpx.get(f"{base}/metrics", headers=token, timeout=30).text
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        modes = _modes(data_dir)
    finally:
        assert process.stop() == 0
    for name in ("loraserve.db", "usage.journal", "server-secret"):
        assert modes[name] == 0o600, (name, oct(modes[name]))
    assert modes["."] == 0o700 and modes["adapter-cache"] == 0o700
    too_open = {path: oct(mode) for path, mode in modes.items() if mode & 0o077}
    assert too_open == {}, too_open  # nothing under the data dir is readable by group or others


def _lora_info_while_running(base: str) -> dict[str, str]:
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info")
        labels = family.samples[0].labels if family.samples else {}
        if labels.get("running_lora_adapters") or time.monotonic() > deadline:
            return labels
        time.sleep(0.05)
