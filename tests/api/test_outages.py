"""A dependency that is down is a retryable 503, never a 500, and says nothing about itself.

Real servers whose PostgreSQL or S3 traffic goes through a TCP proxy the test cuts
(tests/harness/tcp_proxy.py):
during a PostgreSQL outage every request that needs the database is 503 + Retry-After and /ready is
503 while /health and /metrics still answer; during an S3 outage a request for an adapter not yet
loaded is 503 `adapter_unavailable` + Retry-After (streams too: before the 200), uploads are 503;
after each outage the same requests succeed again. No body names a host, port, bucket, object key
or tenant id.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.types import AdapterRef
from registry.disk_cache import DiskTier
from registry.errors import StoreUnavailable
from registry.store import LocalStore, put_content
from registry.types import make_source
from tests.harness.hanging_proxy import HangingProxy
from tests.harness.postgres import new_database
from tests.harness.s3 import s3_backend
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, bearer, main_server_args
from tests.harness.tcp_proxy import TcpProxy
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.wait import wait_for

BASE = "tiny-llama"


def assert_unavailable(r: httpx.Response, codes: set[str], secrets: list[str]) -> None:
    assert r.status_code == 503, (r.request.method, r.request.url, r.status_code, r.text)
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["code"] in codes and error["type"] == "service_unavailable_error", error
    leaked = [s for s in secrets if s in r.text] + re.findall(r"[a-z0-9+.-]+://|sha256/", r.text)
    assert not leaked, (leaked, r.text)


@pytest.mark.slow
def test_postgres_outage_is_503_with_retry_after_then_recovers(
    tiny_llama_dir: Path, tmp_path: Path, postgres_url: str
) -> None:
    direct = new_database(postgres_url)
    port = int(re.search(r"@127\.0\.0\.1:(\d+)/", direct).group(1))  # type: ignore[union-attr]
    with TcpProxy("127.0.0.1", port) as proxy:
        proxied = direct.replace(f"127.0.0.1:{port}/", f"{proxy.address}/")
        args = main_server_args(tiny_llama_dir) + ["--db", proxied]
        process = ServerProcess(args, tmp_path / "data", env={"LORASERVE_ADMIN_KEY": ADMIN_KEY}).start()
        try:
            base = process.base_url
            tenant = httpx.post(
                f"{base}/admin/api/tenants", json={"name": "pg"}, headers=bearer(ADMIN_KEY)
            ).json()
            key, tenant_id = tenant["api_key"], tenant["id"]
            adapter = files_of(peft_adapter(tmp_path / "adapter"))
            server = Server(process, ADMIN_KEY, "postgres-proxied")
            assert upload(server, key, "bot", adapter).status_code == 201
            chat = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            completion = {"model": BASE, "prompt": "hi", "max_tokens": 2}
            requests: list[tuple[str, str, dict[str, Any]]] = [
                ("POST", "/v1/chat/completions", {"json": chat, "headers": bearer(key)}),
                ("POST", "/v1/chat/completions", {"json": {**chat, "model": "bot"}, "headers": bearer(key)}),
                ("POST", "/v1/completions", {"json": {**completion, "stream": True}, "headers": bearer(key)}),
                ("GET", "/v1/models", {"headers": bearer(key)}),
                ("GET", "/v1/adapters", {"headers": bearer(key)}),
                ("GET", "/v1/usage", {"headers": bearer(key)}),
                ("GET", "/admin/api/tenants", {"headers": bearer(ADMIN_KEY)}),
                ("GET", f"/admin/api/tenants/{tenant_id}/keys", {"headers": bearer(ADMIN_KEY)}),
                ("GET", "/admin/api/usage", {"headers": bearer(ADMIN_KEY)}),
            ]
            for method, path, kwargs in requests:
                assert httpx.request(method, base + path, timeout=60, **kwargs).status_code == 200, path

            proxy.cut()
            secrets = [proxy.address, str(port), "postgres", "psycopg", tenant_id, str(process.data_dir)]
            codes = {"database_unavailable", "usage_unavailable"}
            for method, path, kwargs in requests:
                assert_unavailable(httpx.request(method, base + path, timeout=60, **kwargs), codes, secrets)
            r = upload(server, key, "bot2", adapter)
            assert_unavailable(r, codes, secrets)
            assert_unavailable(httpx.get(f"{base}/ready", timeout=30), {"not_ready"}, secrets)
            assert httpx.get(f"{base}/health", timeout=30).status_code == 200  # liveness is not readiness
            assert httpx.get(f"{base}/metrics", timeout=30).status_code == 200

            proxy.restore()
            wait_for(
                lambda: httpx.get(f"{base}/ready", timeout=30).status_code == 200,
                60,
                interval=0.2,
                what="ready again",
            )
            for method, path, kwargs in requests:
                assert httpx.request(method, base + path, timeout=60, **kwargs).status_code == 200, path
        finally:
            proxy.restore()
            assert process.stop() == 0, process.log()[-3000:]


@pytest.mark.slow
def test_stopped_postgres_is_503_within_the_database_timeout(
    tiny_llama_dir: Path, tmp_path: Path, postgres_url: str
) -> None:
    """A database that stops answering while its host still acknowledges (what SIGSTOP looks like; here
    a proxy that swallows every byte): requests that need it are 503 `database_unavailable` within
    `db_timeout_s`, /health stays fast, and service comes back when the database does."""
    direct = new_database(postgres_url)
    host_port = direct.split("@", 1)[1].split("/", 1)[0]
    with HangingProxy(host_port) as proxy:
        args = main_server_args(tiny_llama_dir) + [
            "--db",
            direct.replace(host_port, proxy.url.removeprefix("http://")),
        ]
        env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY, "LORASERVE_DB_TIMEOUT_S": "3"}
        process = ServerProcess(args, tmp_path / "data", env=env).start()
        try:
            base = process.base_url
            key = httpx.post(
                f"{base}/admin/api/tenants", json={"name": "hung"}, headers=bearer(ADMIN_KEY)
            ).json()["api_key"]
            chat = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            requests: list[tuple[str, str, dict[str, Any]]] = [
                ("POST", "/v1/chat/completions", {"json": chat, "headers": bearer(key)}),
                ("GET", "/v1/models", {"headers": bearer(key)}),
                ("GET", "/admin/api/tenants", {"headers": bearer(ADMIN_KEY)}),
            ]
            for method, path, kwargs in requests:
                assert httpx.request(method, base + path, timeout=60, **kwargs).status_code == 200, path

            proxy.hang()
            secrets = [proxy.url, host_port, "postgres", "psycopg", str(process.data_dir)]
            for method, path, kwargs in requests * 2:  # the first meets pooled connections, later ones new
                start = time.monotonic()
                r = httpx.request(method, base + path, timeout=30, **kwargs)
                assert time.monotonic() - start < 3 + 1.5, (path, time.monotonic() - start)
                assert_unavailable(r, {"database_unavailable"}, secrets)
                start = time.monotonic()
                assert httpx.get(f"{base}/health", timeout=30).status_code == 200
                assert time.monotonic() - start < 0.5

            proxy.resume()
            url = f"{base}/v1/chat/completions"
            wait_for(
                lambda: httpx.post(url, json=chat, headers=bearer(key), timeout=30).status_code == 200,
                30,
                interval=0.2,
                what="served again",
            )
        finally:
            proxy.resume()
            assert process.stop() == 0, process.log()[-3000:]


@pytest.mark.slow
def test_s3_outage_is_a_retryable_503_for_adapters_not_yet_loaded(
    tiny_llama_dir: Path, tmp_path: Path, s3_server: str
) -> None:
    s3 = s3_backend(s3_server, tmp_path)
    host, port = s3_server.removeprefix("http://").split(":")
    with TcpProxy(host, int(port)) as proxy:
        env = {k: v for k, v in s3.items() if k.startswith("AWS_")} | {
            "AWS_ENDPOINT_URL": f"http://{proxy.address}",
            "LORASERVE_ADMIN_KEY": ADMIN_KEY,
        }
        args = main_server_args(tiny_llama_dir) + ["--registry", f"s3://{s3['bucket']}/registry"]
        process = ServerProcess(args, tmp_path / "data", env=env).start()
        try:
            base = process.base_url
            tenant = httpx.post(
                f"{base}/admin/api/tenants", json={"name": "s3"}, headers=bearer(ADMIN_KEY)
            ).json()
            key, tenant_id = tenant["api_key"], tenant["id"]
            server = Server(process, ADMIN_KEY, "s3-proxied")
            files = files_of(peft_adapter(tmp_path / "adapter", seed=3))
            assert upload(server, key, "cold", files).status_code == 201
            cold = httpx.get(f"{base}/v1/adapters/cold", headers=bearer(key)).json()
            assert cold["versions"][0]["residency"] == "store"  # not yet loaded anywhere

            proxy.cut()
            secrets = [proxy.address, s3_server, s3["bucket"], tenant_id, "registry/", str(process.data_dir)]
            chat = {"model": "cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            url = f"{base}/v1/chat/completions"
            r = httpx.post(url, json=chat, headers=bearer(key), timeout=120)
            assert_unavailable(r, {"adapter_unavailable"}, secrets)
            assert r.headers["x-request-id"].startswith("chatcmpl-")
            r = httpx.post(url, json={**chat, "stream": True}, headers=bearer(key), timeout=120)
            assert_unavailable(r, {"adapter_unavailable"}, secrets)  # a 503, not an error after a 200
            other = files_of(peft_adapter(tmp_path / "other", seed=4))
            assert_unavailable(upload(server, key, "new", other), {"store_unavailable"}, secrets)
            r = httpx.post(url, json={**chat, "model": BASE}, headers=bearer(key), timeout=120)
            assert r.status_code == 200  # the base model never needs the store

            proxy.restore()

            def served() -> bool:
                r = httpx.post(url, json=chat, headers=bearer(key), timeout=120)
                assert r.status_code in (200, 503), r.text
                return r.status_code == 200

            wait_for(served, 60, what="the adapter served once S3 is back")
        finally:
            proxy.restore()
            assert process.stop() == 0, process.log()[-3000:]


def test_adapter_fetch_tells_an_unreachable_store_from_other_failures(tmp_path: Path) -> None:
    from api.inference.adapter_fetch import AdapterFetch, StoreUnreachable

    store = LocalStore(tmp_path / "objects")
    source = peft_adapter(tmp_path / "adapter")
    config, weights = (
        put_content(store, source / name) for name in ("adapter_config.json", "adapter_model.safetensors")
    )
    ref = AdapterRef(
        id=f"{uuid.uuid4().hex}/bot@1", sha256=weights, source=make_source(config, weights), name="bot"
    )
    real_get = store.get

    def down(key: str, dest: Path) -> None:
        raise StoreUnavailable("cannot reach S3 endpoint http://10.1.2.3:9000 (get s3://bucket/sha256/...)")

    store.get = down  # type: ignore[method-assign]
    fetch = AdapterFetch(DiskTier(tmp_path / "disk", store), wait_s=30)
    with pytest.raises(StoreUnreachable) as info:
        fetch(ref)
    assert "10.1.2.3" not in str(info.value) and fetch.is_unreachable(ref.id)
    store.get = real_get  # type: ignore[method-assign]
    assert (fetch(ref) / "adapter_model.safetensors").is_file() and not fetch.is_unreachable(ref.id)
    assert (tmp_path / "disk").stat().st_mode & 0o777 == 0o700
    fetch.shutdown()
