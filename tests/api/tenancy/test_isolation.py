"""Tenant isolation: B cannot list, call, inspect or delete A's adapter, before and after A warmed it.

"Not yours" must look exactly like "does not exist" (platform.md 4.3): the 404 bodies for A's
adapter name are compared with those for a name nobody has, with the name substituted.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.harness.servers import Server
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow  # real servers

SECRET, UNKNOWN = "secret-bot", "nobody-has"


def _b_sees(server: Server, key: str, name: str) -> list[tuple[int, str]]:
    """Every way B can touch adapter `name`: status and body (with the name blanked out)."""
    auth = {"Authorization": f"Bearer {key}"}
    url = server.base_url
    responses = [
        httpx.get(f"{url}/v1/adapters/{name}", headers=auth),
        httpx.delete(f"{url}/v1/adapters/{name}", headers=auth),
        httpx.delete(f"{url}/v1/adapters/{name}", params={"version": 1}, headers=auth),
        httpx.get(f"{url}/v1/models/{name}", headers=auth),
        httpx.post(
            f"{url}/v1/completions", headers=auth, json={"model": name, "prompt": "hi", "max_tokens": 2}
        ),
        httpx.post(
            f"{url}/v1/chat/completions",
            headers=auth,
            json={"model": f"{name}@1", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        ),
    ]
    return [(r.status_code, r.text.replace(name, "NAME")) for r in responses]


def _listings(server: Server, key: str) -> tuple[list[str], list[str]]:
    auth = {"Authorization": f"Bearer {key}"}
    models = [m["id"] for m in httpx.get(f"{server.base_url}/v1/models", headers=auth).json()["data"]]
    adapters = [a["name"] for a in httpx.get(f"{server.base_url}/v1/adapters", headers=auth).json()["data"]]
    return models, adapters


def _check_b_is_blind(server: Server, key_b: str) -> None:
    seen = _b_sees(server, key_b, SECRET)
    assert all(status == 404 for status, _ in seen), seen
    assert seen == _b_sees(server, key_b, UNKNOWN)
    assert _listings(server, key_b) == (["tiny-llama"], [])


def test_tenant_b_cannot_reach_tenant_a_adapter(server: Server, tmp_path: Path) -> None:
    tenant_a, key_a = server.tenant("a")
    _, key_b = server.tenant("b")
    assert upload(server, key_a, SECRET, files_of(peft_adapter(tmp_path / "a"))).status_code == 201
    _check_b_is_blind(server, key_b)

    # A warms its adapter into the engine (a request, then an operator pin); B still sees nothing.
    auth_a = {"Authorization": f"Bearer {key_a}"}
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=auth_a,
        json={"model": SECRET, "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert server.admin("POST", f"/tenants/{tenant_a}/adapters/{SECRET}/pin").status_code == 200

    def residency() -> str:
        return httpx.get(f"{server.base_url}/v1/adapters/{SECRET}", headers=auth_a).json()["versions"][0][
            "residency"
        ]

    wait_for(lambda: residency() == "gpu", 30, interval=0.2, what="A's pinned adapter in a GPU slot")
    _check_b_is_blind(server, key_b)
    # B's delete attempts changed nothing for A.
    assert _listings(server, key_a) == (["tiny-llama", SECRET], [SECRET])
    assert server.admin("POST", f"/tenants/{tenant_a}/adapters/{SECRET}/unpin").status_code == 200


def test_suspended_tenant_keys_stop_working(server: Server) -> None:
    tenant, key = server.tenant("s")
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{server.base_url}/v1/models", headers=auth).status_code == 200
    assert server.admin("POST", f"/tenants/{tenant}/suspend").json()["status"] == "suspended"
    assert httpx.get(f"{server.base_url}/v1/models", headers=auth).status_code == 401
    assert server.admin("POST", f"/tenants/{tenant}/activate").json()["status"] == "active"
    assert httpx.get(f"{server.base_url}/v1/models", headers=auth).status_code == 200


@pytest.mark.parametrize("path", ["/tenants", "/adapters", "/audit", "/engine"])
def test_admin_routes_refuse_tenant_keys(server: Server, path: str) -> None:
    _, key = server.tenant("k")
    r = httpx.get(f"{server.base_url}/admin/api{path}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"


def test_prefix_cache_is_salted_per_tenant(server: Server) -> None:
    """Same prompt: the same tenant hits its own cached prefix, another tenant never does."""
    prompt = "The cache keeps recently used blocks in memory. " * 6  # several full KV blocks

    def cached(key: str) -> int:
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 1},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    _, key_a = server.tenant("salt-a")
    _, key_b = server.tenant("salt-b")
    assert cached(key_a) == 0
    assert cached(key_a) > 0
    assert cached(key_b) == 0
