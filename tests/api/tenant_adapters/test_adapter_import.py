"""Adapters by reference: `POST /v1/adapters/import` and the admin's, from moto's S3 over HTTP.

One real server (SQLite, registry on S3) whose allowlist names an import prefix, the registry's own
bucket (listed on purpose: it must still be refused) and a local directory (file:// switched on);
each test tenant is granted those prefixes by the admin (`ImportServer.tenant`), unless it asks not to be.
Oracles: sha256 of the source bytes, the multipart upload of the same files (same version), the
base model's greedy output (the imported adapter changes it), the registry's object listing.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from api.errors import APIError
from api.settings import Settings
from api.tenant_adapters.import_sources import check_source
from api.tenant_adapters.imports import download_adapter_files, import_error
from api.tenant_adapters.uploads import UploadLimits
from registry.errors import ObjectNotFound, StoreUnavailable
from registry.stores import open_store
from tests.harness.s3 import s3_backend, s3_client
from tests.harness.servers import (
    ADMIN_KEY,
    MAX_UPLOAD_BYTES,
    Server,
    ServerProcess,
    free_port,
    main_server_args,
)
from tests.harness.uploads import CONFIG, WEIGHTS, files_of, peft_adapter, peft_adapter_on, upload


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return files_of(peft_adapter(tmp_path_factory.mktemp("imp-good") / "a"))


@dataclass
class ImportServer(Server):
    source: dict[str, str] = None  # type: ignore[assignment]  # AWS_* env and the import bucket
    local: Path = None  # type: ignore[assignment]  # an allowlisted local directory
    prefixes: list[str] = None  # type: ignore[assignment]  # the server's adapter_import_prefixes

    def tenant(self, prefix: str = "t", *, granted: bool = True) -> tuple[str, str]:
        """A new tenant, by default granted every prefix the server allows."""
        tenant_id, key = super().tenant(prefix)
        if granted:
            r = self.admin("PUT", f"/tenants/{tenant_id}/import-prefixes", json={"prefixes": self.prefixes})
            assert r.status_code == 200, r.text
        return tenant_id, key


@pytest.fixture(scope="module")
def imp(
    s3_server: str, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ImportServer]:
    tmp = tmp_path_factory.mktemp("import-server")
    registry = s3_backend(s3_server, tmp)
    source = s3_backend(s3_server, tmp)
    local = tmp / "local"
    local.mkdir()
    prefixes = [f"s3://{source['bucket']}/ok", f"s3://{registry['bucket']}", local.as_uri()]
    env = {
        "LORASERVE_ADMIN_KEY": ADMIN_KEY,
        "LORASERVE_ADAPTER_IMPORT_PREFIXES": json.dumps(prefixes),
        "LORASERVE_ADAPTER_IMPORT_ALLOW_FILE": "true",
        **{k: v for k, v in registry.items() if k.startswith("AWS_")},
    }
    args = [*main_server_args(tiny_llama_dir), "--registry", f"s3://{registry['bucket']}/registry"]
    process = ServerProcess(args, tmp / "data", env=env).start()
    try:
        yield ImportServer(
            process, ADMIN_KEY, "sqlite-s3", registry, source=source, local=local, prefixes=prefixes
        )
    finally:
        assert process.stop() == 0, process.log()[-4000:]


def _put(server: ImportServer, prefix: str, files: dict[str, bytes], *, bucket: str | None = None) -> str:
    """The files under s3://<source bucket>/<prefix>/ (or `bucket`); returns that URI."""
    s3 = server.source
    bucket = bucket or s3["bucket"]
    for name, content in files.items():
        s3_client(s3).put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=content)
    return f"s3://{bucket}/{prefix}"


def _import(server: ImportServer, key: str, name: str, uri: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/adapters/import",
        headers={"Authorization": f"Bearer {key}"},
        json={"name": name, "uri": uri},
        timeout=120,
    )


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return dict(r.json()["error"])


def _unique() -> str:
    return uuid.uuid4().hex[:8]


@pytest.mark.slow
def test_import_registers_and_serves(imp: ImportServer, good: dict[str, bytes]) -> None:
    _, key = imp.tenant("imp")
    r = _import(imp, key, "bot", _put(imp, f"ok/{_unique()}", good))
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["version"], body["status"]) == ("bot", 1, "ready")
    assert body["sha256"] == hashlib.sha256(good[WEIGHTS]).hexdigest()
    assert body["config_sha256"] == hashlib.sha256(good[CONFIG]).hexdigest()
    client = openai.OpenAI(base_url=f"{imp.base_url}/v1", api_key=key, max_retries=0)

    def greedy(model: str) -> str:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
        )
        return str(out.choices[0].message.content)

    assert greedy("bot") != greedy("tiny-llama")  # the adapter is applied
    assert [m.id for m in client.models.list().data] == ["tiny-llama", "bot"]


@pytest.mark.slow
def test_identical_import_twice_is_the_same_version(imp: ImportServer, good: dict[str, bytes]) -> None:
    _, key = imp.tenant("twice")
    uri = _put(imp, f"ok/{_unique()}", good)
    first = _import(imp, key, "same", uri)
    assert first.status_code == 201, first.text
    again = _import(imp, key, "same", uri)
    assert (again.status_code, again.json()["version"]) == (200, 1), again.text
    multipart = upload(imp, key, "same", good)  # the upload path agrees: one version
    assert (multipart.status_code, multipart.json()["version"]) == (200, 1), multipart.text


@pytest.mark.slow
def test_not_allowlisted_is_403_and_names_the_setting(imp: ImportServer, good: dict[str, bytes]) -> None:
    _, key = imp.tenant("deny")
    source = imp.source["bucket"]
    for uri in (_put(imp, f"elsewhere/{_unique()}", good), f"s3://{source}/okay", f"s3://{source}"):
        error = _error(_import(imp, key, "x", uri), 403)
        assert "adapter_import_prefixes" in error["message"] and error["code"] == "import_source_forbidden"
        assert source not in error["message"]


@pytest.mark.slow
def test_registry_is_never_importable(imp: ImportServer, good: dict[str, bytes]) -> None:
    """The registry's bucket is allowlisted, yet nothing under its registry prefix is read."""
    _, key = imp.tenant("reg")
    bucket = imp.s3["bucket"]  # type: ignore[index]
    uri = _put(imp, "registry/planted", good, bucket=bucket)
    for target in (uri, f"s3://{bucket}/registry", f"s3://{bucket}/registry/sha256"):
        error = _error(_import(imp, key, "x", target), 403)
        assert "registry" in error["message"] and bucket not in error["message"]
    # Outside the registry prefix the allowlisted bucket is an ordinary source.
    assert _import(imp, key, "x", _put(imp, "shelf/a", good, bucket=bucket)).status_code == 201


@pytest.mark.slow
def test_oversized_objects_are_413_before_download(imp: ImportServer, good: dict[str, bytes]) -> None:
    _, key = imp.tenant("big")
    big_weights = {**good, WEIGHTS: b"\0" * (MAX_UPLOAD_BYTES + 1)}
    big_config = {**good, CONFIG: b" " * ((1 << 20) + 1)}
    for files, named in ((big_weights, WEIGHTS), (big_config, CONFIG)):
        error = _error(_import(imp, key, "big", _put(imp, f"ok/{_unique()}", files)), 413)
        assert named in error["message"] and error["code"] == "payload_too_large"
    r = httpx.get(f"{imp.base_url}/v1/adapters/big", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 404


@pytest.mark.slow
def test_broken_objects_are_400_and_missing_ones_404_with_the_cause(
    imp: ImportServer, good: dict[str, bytes], tmp_path: Path
) -> None:
    _, key = imp.tenant("broken")
    other = files_of(peft_adapter_on(tmp_path / "other", hidden_size=32))  # trained for another size
    error = _error(_import(imp, key, "bad", _put(imp, f"ok/{_unique()}", other)), 400)
    assert error["code"] == "invalid_adapter" and "shape" in error["message"]
    missing = _put(imp, f"ok/{_unique()}", {CONFIG: good[CONFIG]})
    error = _error(_import(imp, key, "bad", missing), 404)
    assert WEIGHTS in error["message"] and error["code"] == "import_object_not_found"
    no_bucket = f"s3://nope-{_unique()}/ok"
    assert _error(_import(imp, key, "bad", no_bucket), 403)["code"] == "import_source_forbidden"
    assert _error(_import(imp, key, "../bad", missing), 400)["code"] == "invalid_name"
    assert _error(_import(imp, key, "bad", "https://example.com/a"), 400)["param"] == "uri"
    stored = imp.store_keys()
    assert not any(k.endswith(hashlib.sha256(other[WEIGHTS]).hexdigest()) for k in stored)


@pytest.mark.slow
def test_another_tenants_source_is_the_same_404_as_a_missing_one(
    imp: ImportServer, good: dict[str, bytes]
) -> None:
    """The admin granted A and B the same prefixes; A imported first, so the source is A's."""
    _, key_a = imp.tenant("owner")
    _, key_b = imp.tenant("other")
    uri = _put(imp, f"ok/{_unique()}", good)
    assert _import(imp, key_a, "mine", uri).status_code == 201
    taken = _error(_import(imp, key_b, "mine", uri), 404)
    missing = _error(_import(imp, key_b, "mine", f"s3://{imp.source['bucket']}/ok/{_unique()}"), 404)
    assert taken == missing and taken["code"] == "import_object_not_found"
    r = httpx.get(f"{imp.base_url}/v1/adapters", headers={"Authorization": f"Bearer {key_b}"})
    assert r.json()["data"] == []  # nothing of A's reached B
    assert _import(imp, key_a, "mine", uri).status_code == 200  # still A's: the same version again


@pytest.mark.slow
def test_imports_are_per_tenant_and_granted_by_the_admin(imp: ImportServer, good: dict[str, bytes]) -> None:
    tenant_id, key = imp.tenant("ungranted", granted=False)
    uri = _put(imp, f"ok/{_unique()}", good)
    error = _error(_import(imp, key, "x", uri), 403)
    assert "import_prefixes" in error["message"] and error["code"] == "import_source_forbidden"
    ok_prefix = f"s3://{imp.source['bucket']}/ok"
    outside = imp.admin(
        "PUT", f"/tenants/{tenant_id}/import-prefixes", json={"prefixes": [f"s3://{imp.source['bucket']}/x"]}
    )
    assert outside.status_code == 400 and "adapter_import_prefixes" in outside.json()["error"]["message"]
    narrow = f"{ok_prefix}/{_unique()}"
    r = imp.admin("PUT", f"/tenants/{tenant_id}/import-prefixes", json={"prefixes": [narrow, narrow]})
    assert r.status_code == 200 and r.json()["prefixes"] == [narrow], r.text
    assert imp.admin("GET", f"/tenants/{tenant_id}/import-prefixes").json()["prefixes"] == [narrow]
    error = _error(_import(imp, key, "x", uri), 403)  # under the server's bound, not under the tenant's
    assert "import_prefixes" in error["message"]
    assert _import(imp, key, "x", _put(imp, narrow.split("/", 3)[3] + "/a", good)).status_code == 201
    assert imp.admin("GET", "/tenants/no-such-tenant/import-prefixes").status_code == 404
    tenant_side = httpx.get(
        f"{imp.base_url}/admin/api/tenants/{tenant_id}/import-prefixes",
        headers={"Authorization": f"Bearer {key}"},
    )
    assert tenant_side.status_code == 401


@pytest.mark.slow
def test_admin_imports_for_a_tenant(imp: ImportServer, good: dict[str, bytes]) -> None:
    tenant_id, key = imp.tenant("adm")
    uri = _put(imp, f"ok/{_unique()}", good)
    r = imp.admin("POST", f"/tenants/{tenant_id}/adapters/import", json={"name": "ops", "uri": uri})
    assert r.status_code == 201, r.text
    listing = httpx.get(f"{imp.base_url}/v1/adapters", headers={"Authorization": f"Bearer {key}"}).json()
    assert [a["name"] for a in listing["data"]] == ["ops"]
    audit = imp.admin("GET", "/audit", params={"tenant_id": tenant_id}).json()["data"]
    assert any(e["action"] == "adapter.upload" and e["actor"] == "admin" for e in audit)
    tenant_side = httpx.post(
        f"{imp.base_url}/admin/api/tenants/{tenant_id}/adapters/import",
        headers={"Authorization": f"Bearer {key}"},
        json={"name": "ops", "uri": uri},
    )
    assert tenant_side.status_code == 401
    unknown = imp.admin("POST", "/tenants/no-such-tenant/adapters/import", json={"name": "ops", "uri": uri})
    assert unknown.status_code == 404
    denied = imp.admin(
        "POST", f"/tenants/{tenant_id}/adapters/import", json={"name": "x", "uri": "s3://a-b/c"}
    )
    assert denied.status_code == 403


@pytest.mark.slow
def test_file_source_where_allowed_and_links_out_refused(imp: ImportServer, good: dict[str, bytes]) -> None:
    _, key = imp.tenant("local")
    directory = imp.local / _unique()
    directory.mkdir()
    for name, content in good.items():
        (directory / name).write_bytes(content)
    assert _import(imp, key, "disk", directory.as_uri()).status_code == 201
    linked = imp.local / _unique()
    linked.mkdir()
    (linked / CONFIG).write_bytes(good[CONFIG])
    os.symlink(directory / WEIGHTS, linked / WEIGHTS)  # a link out of its own directory
    assert _error(_import(imp, key, "link", linked.as_uri()), 403)["code"] == "import_source_forbidden"
    data_dir = imp.process.data_dir.resolve().as_uri()
    assert _error(_import(imp, key, "data", data_dir), 403)["code"] == "import_source_forbidden"


# ---- without a server: the defaults and an unreachable store -------------------------------------


def test_imports_are_off_by_default() -> None:
    settings = Settings(adapter_import_prefixes=[])
    with pytest.raises(APIError) as refused:
        check_source(settings, "s3://bucket/prefix")
    assert refused.value.status == 403 and "adapter_import_prefixes" in refused.value.message
    settings = Settings(adapter_import_prefixes=["file:///srv/adapters"])
    with pytest.raises(APIError) as refused:
        check_source(settings, "file:///srv/adapters/a")
    assert refused.value.status == 403 and "adapter_import_allow_file" in refused.value.message


def test_control_characters_in_a_uri_are_400() -> None:
    settings = Settings(adapter_import_prefixes=["s3://bucket/prefix"])
    for uri in ("s3://bucket/prefix/a\x00b", "s3://bucket/prefix/a\nb"):
        with pytest.raises(APIError) as refused:
            check_source(settings, uri)
        assert refused.value.status == 400 and "control characters" in refused.value.message


def test_unreachable_store_is_503_with_retry_after(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    store = open_store("s3://bucket/prefix", max_attempts=1, connect_timeout_s=1, read_timeout_s=1)
    with pytest.raises(StoreUnavailable) as down:
        download_adapter_files(store, tmp_path, UploadLimits(body_bytes=1 << 20, weights_bytes=1 << 20))
    error = import_error(down.value)
    assert error.status == 503 and error.headers["Retry-After"]
    assert "127.0.0.1" not in json.dumps(error.body()) and "bucket" not in error.message
    assert not list(tmp_path.iterdir())


def test_store_size_reads_no_bytes_and_names_missing(store_url: str, tmp_path: Path) -> None:
    store = open_store(store_url)
    (tmp_path / "f").write_bytes(b"x" * 1234)
    store.put("a/f", tmp_path / "f")
    assert store.size("a/f") == 1234
    with pytest.raises(ObjectNotFound):
        store.size("a/missing")


def test_oversized_weights_are_refused_before_any_download(tmp_path: Path) -> None:
    source, dest = tmp_path / "source", tmp_path / "dest"
    source.mkdir(), dest.mkdir()
    (source / CONFIG).write_text("{}")
    (source / WEIGHTS).write_bytes(b"\0" * 2049)
    with pytest.raises(APIError) as refused:
        download_adapter_files(
            open_store(source.as_uri()), dest, UploadLimits(body_bytes=4096, weights_bytes=2048)
        )
    assert refused.value.status == 413 and WEIGHTS in refused.value.message
    assert not list(dest.iterdir())  # not even the small config was fetched
    (source / WEIGHTS).write_bytes(b"\0" * 2048)
    with pytest.raises(APIError) as refused:  # each fits, both together do not
        download_adapter_files(
            open_store(source.as_uri()), dest, UploadLimits(body_bytes=2049, weights_bytes=2048)
        )
    assert refused.value.status == 413 and not list(dest.iterdir())


@pytest.mark.slow
def test_openapi_lists_the_import_statuses(imp: ImportServer) -> None:
    paths = httpx.get(f"{imp.base_url}/openapi.json").json()["paths"]
    for path in ("/v1/adapters/import", "/admin/api/tenants/{tenant_id}/adapters/import"):
        statuses = set(paths[path]["post"]["responses"])
        assert {"201", "400", "403", "413", "503"} <= statuses, (path, statuses)


@pytest.mark.slow
def test_quotas_and_the_base_name_apply_as_for_uploads(imp: ImportServer, good: dict[str, bytes]) -> None:
    tenant_id, key = imp.tenant("quota")
    uri = _put(imp, f"ok/{_unique()}", good)
    assert _error(_import(imp, key, "tiny-llama", uri), 409)["code"] == "conflict"
    assert imp.admin("PUT", f"/tenants/{tenant_id}/quotas", json={"max_adapters": 0}).status_code == 200
    assert _error(_import(imp, key, "q", uri), 429)["param"] == "max_adapters"
    r = imp.admin("PUT", f"/tenants/{tenant_id}/quotas", json={"max_adapter_bytes": len(good[WEIGHTS]) - 1})
    assert r.status_code == 200
    assert _error(_import(imp, key, "q", uri), 429)["param"] == "max_adapter_bytes"
