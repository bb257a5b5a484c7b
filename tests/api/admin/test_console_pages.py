"""The admin console's Tenants, Adapters, Usage and Overview pages over HTTP, in process.

Oracles: the admin REST API and the tenant endpoints (a key works or not), hashlib and file sizes
of an adapter saved by peft, sums of usage records this test wrote itself, and the engine's own
count of finished requests.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from api.admin.console import AlarmConfig, GoodputWindow, Slo
from api.state import AppState
from registry.usage import UsageRecord, write_usage
from tests.api.admin.console_helpers import (
    admin_api,
    browser,
    create_tenant,
    login,
    new_tenant_name,
    peft_adapter,
    tenant_key_works,
)
from tests.harness.wait import wait_for


@pytest.fixture
def state(app_state: tuple[FastAPI, AppState]) -> AppState:
    return app_state[1]


# ---- tenants and keys -------------------------------------------------------------------------------


def test_create_tenant_shows_its_working_key_once(app: FastAPI) -> None:
    client = browser(app)
    csrf = login(client)
    name = new_tenant_name()
    page = client.post("/admin/tenants", data={"name": name, "csrf_token": csrf})
    assert page.headers["cache-control"] == "no-store"
    assert "content-security-policy" in page.headers and page.headers["x-frame-options"] == "DENY"
    tenant_id, key = create_tenant(client, csrf, new_tenant_name())
    assert key.startswith("lsk-") and tenant_key_works(app, key)
    listing = client.get("/admin/tenants").text
    detail = client.get(f"/admin/tenants/{tenant_id}").text
    assert name in listing and key not in listing and key not in detail
    assert "tenant.create" in detail  # audit trail
    again = client.post("/admin/tenants", data={"name": name, "csrf_token": csrf})  # name taken
    assert again.status_code == 303 and "already taken" in client.get(again.headers["location"]).text


def test_issue_and_revoke_keys(app: FastAPI) -> None:
    client = browser(app)
    csrf = login(client)
    tenant_id, first = create_tenant(client, csrf, new_tenant_name())
    page = client.post(f"/admin/tenants/{tenant_id}/keys", data={"label": "ci", "csrf_token": csrf})
    second = re.search(r'<code id="new-api-key">([^<]+)</code>', page.text).group(1)  # type: ignore[union-attr]
    assert second != first and tenant_key_works(app, second)
    prefix = next(
        k["prefix"] for k in admin_api(app, "GET", f"/tenants/{tenant_id}/keys")["data"] if k["label"] == "ci"
    )
    r = client.post(f"/admin/tenants/{tenant_id}/keys/{prefix}/revoke", data={"csrf_token": csrf})
    assert r.status_code == 303 and "revoked" in client.get(r.headers["location"]).text
    assert not tenant_key_works(app, second) and tenant_key_works(app, first)


def test_quotas_form_sets_clears_and_refuses_garbage(app: FastAPI) -> None:
    client = browser(app)
    csrf = login(client)
    tenant_id, _ = create_tenant(client, csrf, new_tenant_name())
    form = {"rpm": "7", "tpm": "", "max_concurrent": "2", "max_adapters": "", "max_adapter_bytes": "1000000"}
    client.post(f"/admin/tenants/{tenant_id}/quotas", data={**form, "csrf_token": csrf})
    quotas = admin_api(app, "GET", f"/tenants/{tenant_id}")["quotas"]
    assert quotas == {
        "rpm": 7,
        "tpm": None,
        "max_concurrent": 2,
        "max_adapters": None,
        "max_adapter_bytes": 1000000,
    }
    r = client.post(f"/admin/tenants/{tenant_id}/quotas", data={**form, "rpm": "lots", "csrf_token": csrf})
    assert "quota rpm must be a whole number" in client.get(r.headers["location"]).text
    assert admin_api(app, "GET", f"/tenants/{tenant_id}")["quotas"]["rpm"] == 7


def test_suspend_and_activate_a_tenant(app: FastAPI) -> None:
    client = browser(app)
    csrf = login(client)
    tenant_id, key = create_tenant(client, csrf, new_tenant_name())
    client.post(f"/admin/tenants/{tenant_id}/status", data={"status": "suspended", "csrf_token": csrf})
    assert not tenant_key_works(app, key)
    client.post(f"/admin/tenants/{tenant_id}/status", data={"status": "active", "csrf_token": csrf})
    assert tenant_key_works(app, key)
    r = client.post(f"/admin/tenants/{tenant_id}/status", data={"status": "paused", "csrf_token": csrf})
    assert "status must be one of" in client.get(r.headers["location"]).text


# ---- adapters ---------------------------------------------------------------------------------------


def upload(app: FastAPI, key: str, name: str, adapter_dir: Path) -> dict[str, Any]:
    files = [
        ("files", (f, (adapter_dir / f).read_bytes(), "application/octet-stream"))
        for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    r = browser(app).post(
        "/v1/adapters", data={"name": name}, files=files, headers={"Authorization": f"Bearer {key}"}
    )
    assert r.status_code == 201, r.text
    return r.json()


def adapter_row(page: str, adapter_id: str) -> str:
    match = re.search(rf'<tr data-adapter="{re.escape(adapter_id)}".*?</tr>', page, re.S)
    assert match, f"{adapter_id} not listed"
    return match.group(0)


def test_adapters_page_lists_every_tenants_adapters_with_residency_and_pins(
    app: FastAPI, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    client = browser(app)
    csrf = login(client)
    tenant_name = new_tenant_name()
    tenant_id, key = create_tenant(client, csrf, tenant_name)
    adapter_dir = peft_adapter(tiny_llama_dir, tmp_path / "lora", rank=4)
    upload(app, key, "helper", adapter_dir)
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    row = adapter_row(client.get("/admin/adapters").text, "helper@1")
    assert f'data-tenant="{tenant_name}"' in row and '<td class="num">4</td>' in row
    assert "q_proj, v_proj" in row or "v_proj, q_proj" in row
    assert (
        f'data-sha256="{hashlib.sha256(weights).hexdigest()}"' in row
        and f'data-bytes="{len(weights)}"' in row
    )
    assert re.search(r"tier-(disk|store)", row) and "pinned" not in row  # not loaded yet

    r = client.post(f"/admin/adapters/{tenant_id}/helper/1/pin", data={"csrf_token": csrf})
    assert "helper@1 pinned" in client.get(r.headers["location"]).text
    # Pinning loads the adapter in the background: the row turns to gpu + pinned within moments.
    wait_for(
        lambda: re.search(
            r"tier-gpu.*badge pinned", adapter_row(client.get("/admin/adapters").text, "helper@1"), re.S
        ),
        20.0,
    )
    client.post(f"/admin/adapters/{tenant_id}/helper/1/unpin", data={"csrf_token": csrf})
    wait_for(lambda: "badge pinned" not in adapter_row(client.get("/admin/adapters").text, "helper@1"), 20.0)

    r = client.post(f"/admin/adapters/{tenant_id}/helper/1/delete", data={"csrf_token": csrf})
    page = client.get(r.headers["location"]).text
    assert "helper@1 deleted" in page and 'data-adapter="helper@1" data-tenant="' + tenant_name not in page
    gone = browser(app).get("/v1/adapters/helper", headers={"Authorization": f"Bearer {key}"})
    assert gone.status_code == 404


def test_adapter_page_shows_the_coverage_report_the_tenant_api_returns(
    app: FastAPI, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    client = browser(app)
    csrf = login(client)
    tenant_id, key = create_tenant(client, csrf, new_tenant_name())
    upload(app, key, "covered", peft_adapter(tiny_llama_dir, tmp_path / "lora", rank=4))
    listing = adapter_row(client.get("/admin/adapters").text, "covered@1")
    assert f'href="/admin/adapters/{tenant_id}/covered/1"' in listing
    report = client.get("/v1/adapters/covered", headers={"Authorization": f"Bearer {key}"}).json()
    coverage = report["versions"][0]["coverage"]
    page = client.get(f"/admin/adapters/{tenant_id}/covered/1")
    assert page.status_code == 200
    kinds = re.search(r'id="coverage-kinds">([^<]*)<', page.text)
    assert kinds and kinds.group(1) == ", ".join(coverage["kinds"]) == "lora"
    shown = re.findall(r'<tr data-layer="(\d+)" data-module="(\w+)">.*?</tr>', page.text, re.S)
    expected = sorted((int(layer), module) for layer, mods in coverage["layers"].items() for module in mods)
    assert [(int(layer), module) for layer, module in shown] == expected and expected
    for layer, modules in coverage["layers"].items():
        for module, fields in modules.items():
            row = re.search(rf'<tr data-layer="{layer}" data-module="{module}">.*?</tr>', page.text, re.S)
            assert row and f'data-value="{fields["delta_fro"]}"' in row.group(0)
            assert f'data-value="{fields["relative_delta"]}"' in row.group(0)
    assert client.get(f"/admin/adapters/{tenant_id}/covered/2").status_code == 404
    assert client.get(f"/admin/adapters/{tenant_id}/nothing/1").status_code == 404


# ---- usage ------------------------------------------------------------------------------------------


def records(
    tenant_id: str, day: datetime, n: int, adapter: tuple[str, int] | None, tokens: tuple[int, int, int]
) -> list[UsageRecord]:
    prompt, cached, completion = tokens
    return [
        UsageRecord(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            tenant_id=tenant_id,
            key_prefix="lsk-test",
            adapter_name=adapter[0] if adapter else None,
            adapter_version=adapter[1] if adapter else None,
            prompt_tokens=prompt,
            cached_prompt_tokens=cached,
            completion_tokens=completion,
            finish_reason="length",
            queue_time_s=0.01,
            ttft_s=0.05,
            total_time_s=0.2,
            created_at=day,
            finished_at=day + timedelta(seconds=1),
        )
        for _ in range(n)
    ]


def test_usage_page_and_csv_add_up_to_the_records(app: FastAPI, state: AppState) -> None:
    client = browser(app)
    csrf = login(client)
    (a_id, _), (b_id, _) = (
        create_tenant(client, csrf, new_tenant_name()),
        create_tenant(client, csrf, new_tenant_name()),
    )
    day1 = datetime(2031, 5, 3, 10, tzinfo=UTC)
    day2 = datetime(2031, 5, 5, 23, 59, tzinfo=UTC)
    written = (
        records(a_id, day1, 3, ("bot", 1), (10, 4, 5))
        + records(a_id, day2, 2, None, (7, 0, 3))
        + records(b_id, day2, 4, ("bot", 2), (20, 0, 1))
        + records(b_id, datetime(2031, 5, 9, tzinfo=UTC), 1, None, (100, 0, 100))  # outside the range
    )
    with state.sessions() as session:
        assert write_usage(session, written) == len(written)
    query = "start=2031-05-01&end=2031-05-06"
    page = client.get(f"/admin/usage?{query}").text
    totals = re.search(
        r'id="usage-totals" data-requests="(\d+)" data-prompt-tokens="(\d+)" data-completion-tokens="(\d+)"',
        page,
    )
    in_range = [r for r in written if r.finished_at < datetime(2031, 5, 7, tzinfo=UTC)]
    expected = (
        len(in_range),
        sum(r.prompt_tokens for r in in_range),
        sum(r.completion_tokens for r in in_range),
    )
    assert totals and tuple(int(g) for g in totals.groups()) == expected
    bars = dict(re.findall(r'data-day="([\d-]+)" data-tokens="(\d+)"', page))
    assert len(bars) == 6 and bars["2031-05-03"] == str(3 * 15) and bars["2031-05-05"] == str(2 * 10 + 4 * 21)
    assert bars["2031-05-04"] == "0"

    by_tenant = list(
        csv.DictReader(io.StringIO(client.get(f"/admin/usage.csv?{query}&group_by=tenant").text))
    )
    assert {row["key"]: int(row["requests"]) for row in by_tenant} == {a_id: 5, b_id: 4}
    assert {row["key"]: int(row["completion_tokens"]) for row in by_tenant} == {a_id: 3 * 5 + 2 * 3, b_id: 4}
    r = client.get(f"/admin/usage.csv?{query}&tenant_id={a_id}&group_by=adapter")
    assert (
        r.headers["content-type"].startswith("text/csv") and "attachment" in r.headers["content-disposition"]
    )
    assert {row["key"]: int(row["cached_prompt_tokens"]) for row in csv.DictReader(io.StringIO(r.text))} == {
        "base": 0,
        "bot@1": 12,
    }
    assert client.get("/admin/usage?start=yesterday").status_code == 400


# ---- overview ---------------------------------------------------------------------------------------


def test_overview_reports_engine_numbers_residency_and_goodput(app: FastAPI, state: AppState) -> None:
    client = browser(app)
    login(client)
    before = client.get("/admin/overview.json").json()
    assert set(before["numbers"]) >= {
        "ttft",
        "itl",
        "queue",
        "prefill",
        "kv_cache_usage",
        "num_waiting",
        "preemptions",
        "prefix_cache_hit_rate",
    }
    assert before["residency"]["gpu"]["total"] == 2 and before["residency"]["cpu"]["total"] == 4
    key = admin_api(app, "POST", "/tenants", json={"name": new_tenant_name()})["api_key"]
    body = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4}
    r = browser(app).post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    after = client.get("/admin/overview.json").json()
    assert after["goodput"]["num_requests"] == before["goodput"]["num_requests"] + 1
    page = client.get("/admin").text
    embedded = re.search(r'<script type="application/json" id="overview-data">(.*?)</script>', page, re.S)
    assert embedded and json.loads(embedded.group(1))["residency"] == after["residency"]


def test_overview_shows_an_alarm_when_goodput_falls_under_the_slo(app: FastAPI, state: AppState) -> None:
    console = app.state.console
    saved = console.goodput, console.alarms
    # A fresh window with an SLO no request can meet, judged from the first request on.
    strict = GoodputWindow(Slo(ttft_s=1e-9, tpot_s=1e-9))
    state.engine.on_finished.append(strict.observe)
    console.goodput, console.alarms = strict, AlarmConfig(min_goodput_requests=1)
    try:
        client = browser(app)
        login(client)
        assert "Goodput under SLO" not in client.get("/admin").text
        key = admin_api(app, "POST", "/tenants", json={"name": new_tenant_name()})["api_key"]
        body = {"model": "tiny-llama", "prompt": "slow on purpose", "max_tokens": 3}
        r = browser(app).post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        alarms = client.get("/admin/overview.json").json()["alarms"]
        assert [a["kind"] for a in alarms] == ["goodput"] and "0 of 1 recent requests" in alarms[0]["message"]
        assert '<div class="alarm" data-kind="goodput">Goodput under SLO' in client.get("/admin").text
    finally:
        state.engine.on_finished.remove(strict.observe)
        console.goodput, console.alarms = saved
