"""Admin REST API: tenants, keys, every tenant's adapters, quotas, audit log, engine statistics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.harness.servers import Server
from tests.harness.uploads import files_of, peft_adapter, upload

pytestmark = pytest.mark.slow  # real servers


def _models(server: Server, key: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})


def test_tenant_lifecycle_and_audit(server: Server, tmp_path: Path) -> None:
    r = server.admin("POST", "/tenants", json={"name": "acme-admin-test"})
    assert r.status_code == 201, r.text
    tenant = r.json()
    assert {"id", "name", "api_key"} <= set(tenant) and tenant["name"] == "acme-admin-test"
    assert server.admin("POST", "/tenants", json={"name": "acme-admin-test"}).status_code == 409
    bad = server.admin("POST", "/tenants", json={"name": "no/slashes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
    tid, first_key = tenant["id"], tenant["api_key"]
    assert tid in [t["id"] for t in server.admin("GET", "/tenants").json()["data"]]

    # Keys: issue a second one, revoke the first; revocation is immediate.
    second = server.admin("POST", f"/tenants/{tid}/keys", json={"label": "ci"}).json()
    assert _models(server, second["api_key"]).status_code == 200
    prefix = first_key.split("-")[1]
    assert server.admin("DELETE", f"/tenants/{tid}/keys/{prefix}").json()["revoked_at"] is not None
    assert _models(server, first_key).status_code == 401
    keys = server.admin("GET", f"/tenants/{tid}/keys").json()["data"]
    assert sorted(k["revoked_at"] is None for k in keys) == [False, True]

    # Adapters of every tenant are visible to the admin, with their owner.
    assert upload(server, second["api_key"], "ops", files_of(peft_adapter(tmp_path / "a"))).status_code == 201
    mine = server.admin("GET", "/adapters", params={"tenant_id": tid}).json()["data"]
    assert [(a["name"], a["tenant_name"]) for a in mine] == [("ops", "acme-admin-test")]

    quotas = {"rpm": 10, "tpm": None, "max_concurrent": 2, "max_adapters": 5, "max_adapter_bytes": None}
    assert server.admin("PUT", f"/tenants/{tid}/quotas", json=quotas).json()["quotas"] == quotas

    # Deleting the tenant: keys stop at once and its adapters stop being served.
    assert server.admin("DELETE", f"/tenants/{tid}").json()["status"] == "deleted"
    assert _models(server, second["api_key"]).status_code == 401
    assert server.admin("GET", "/adapters", params={"tenant_id": tid}).json()["data"] == []

    actions = [e["action"] for e in server.admin("GET", "/audit", params={"tenant_id": tid}).json()["data"]]
    for action in (
        "tenant.create",
        "key.issue",
        "key.revoke",
        "adapter.upload",
        "tenant.quotas",
        "tenant.deleted",
    ):
        assert action in actions


def test_wrong_admin_key_is_refused(server: Server) -> None:
    r = httpx.get(f"{server.base_url}/admin/api/tenants", headers={"Authorization": "Bearer lsa-wrong"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.base_url}/admin/api/tenants").status_code == 401


def test_engine_stats(server: Server) -> None:
    stats = server.engine_stats()
    assert stats["num_kv_blocks_total"] == 256
    assert {"num_running", "num_waiting", "num_kv_blocks_used", "kv_cache_usage", "adapters"} <= set(stats)
