"""A tenant's priority class over real servers: the admin sets it (REST, CLI, console), a request
without `priority` gets it, a less urgent `priority` is accepted, a more urgent one is a 400 naming
both levels, and a malformed one is a 400 naming the field. The scheduler side (levels served
strictly, aging) is tests/base_engine/test_priority.py."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from typer.testing import CliRunner

from api.cli.main import app as cli_app
from tests.api.admin.console_helpers import admin_api, browser, create_tenant, login, new_tenant_name
from tests.harness.servers import Server


def _complete(server: Server, key: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, **extra}
    return httpx.post(
        f"{server.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _base_model(server: Server, key: str) -> str:
    r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    return str(r.json()["data"][0]["id"])


@pytest.mark.slow
def test_admin_sets_the_default_and_requests_may_not_be_more_urgent(server: Server) -> None:
    tenant_id, key = server.tenant("prio")
    assert server.admin("GET", f"/tenants/{tenant_id}").json()["default_priority"] == 0
    r = server.admin("PUT", f"/tenants/{tenant_id}/priority", json={"default_priority": 5})
    assert r.status_code == 200 and r.json()["default_priority"] == 5
    for bad in ({"default_priority": "high"}, {"default_priority": 10_000}, {}):
        assert server.admin("PUT", f"/tenants/{tenant_id}/priority", json=bad).status_code == 400
    assert server.admin("PUT", "/tenants/nope/priority", json={"default_priority": 1}).status_code == 404

    model = _base_model(server, key)
    for ok in ({}, {"priority": 5}, {"priority": 9}):
        r = _complete(server, key, model=model, **ok)
        assert r.status_code == 200, (ok, r.text)
    r = _complete(server, key, model=model, priority=4)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (
        error["param"] == "priority"
        and "4" in error["message"]
        and "default priority is 5" in error["message"]
    )
    r = _complete(server, key, model=model, priority="urgent")
    assert r.status_code == 400 and "priority" in r.text

    audit = server.admin("GET", "/audit", params={"tenant_id": tenant_id}).json()["data"]
    assert "tenant.priority" in [e["action"] for e in audit]


@pytest.mark.slow
@pytest.mark.parametrize("server", ["sqlite-local"], indirect=True)
def test_cli_sets_a_tenant_priority(server: Server) -> None:
    tenant_id, _ = server.tenant("prio-cli")
    env = {"LORASERVE_URL": server.base_url, "LORASERVE_ADMIN_KEY": server.admin_key}
    result = CliRunner().invoke(
        cli_app, ["tenant", "priority", tenant_id, "--level", "-2", "--json"], env=env
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["default_priority"] == -2
    assert server.admin("GET", f"/tenants/{tenant_id}").json()["default_priority"] == -2


def test_console_form_sets_the_priority_and_refuses_garbage(app: FastAPI) -> None:
    client = browser(app)
    csrf = login(client)
    tenant_id, _ = create_tenant(client, csrf, new_tenant_name())
    assert 'id="priority"' in client.get(f"/admin/tenants/{tenant_id}").text
    client.post(f"/admin/tenants/{tenant_id}/priority", data={"default_priority": "3", "csrf_token": csrf})
    assert admin_api(app, "GET", f"/tenants/{tenant_id}")["default_priority"] == 3
    r = client.post(
        f"/admin/tenants/{tenant_id}/priority", data={"default_priority": "x", "csrf_token": csrf}
    )
    assert "default priority must be a whole number" in client.get(r.headers["location"]).text
    assert admin_api(app, "GET", f"/tenants/{tenant_id}")["default_priority"] == 3
