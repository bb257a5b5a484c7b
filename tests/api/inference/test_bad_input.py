"""Wrong answers to bad input, in process on the real app: hostile values get a 4xx in
OpenAI's error shape (never a 500, never FastAPI's 422), /openapi.json lists the statuses routes
really return, and error bodies carry no server path, URL or internal id.

Oracles: the status each input must get (named in the issue), OpenAI's error shape, and the server's
own data directory and tenant ids, which must not appear in any body.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.state import AppState
from base_engine.model.token_bound import max_chars_per_token
from tests.api.admin import console_helpers as ch
from tests.harness.uploads import CONFIG, WEIGHTS, files_of, peft_adapter

BIG = 2**63  # one past the largest BIGINT: every integer field must refuse it with a 400
BASE = "tiny-llama"


@pytest.fixture(scope="module")
def client(app_state: tuple[FastAPI, AppState]) -> TestClient:
    return TestClient(app_state[0], base_url=ch.BASE_URL, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def tenant(client: TestClient) -> dict[str, Any]:
    r = client.post("/admin/api/tenants", json={"name": f"bad-{uuid.uuid4().hex[:8]}"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()


ADMIN = {"Authorization": f"Bearer {ch.ADMIN}"}


def auth(tenant: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant['api_key']}"}


def assert_error(r: Any, status: int, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_integers_past_the_columns_are_400_naming_the_field(
    client: TestClient, tenant: dict[str, Any]
) -> None:
    tid = tenant["id"]
    for method, path, body, param in [
        ("DELETE", f"/v1/adapters/x?version={BIG}", None, "version"),
        ("GET", f"/admin/api/audit?before_id={BIG}", None, "before_id"),
        ("POST", f"/admin/api/tenants/{tid}/adapters/x/pin?version={BIG}", None, "version"),
        ("PUT", f"/admin/api/tenants/{tid}/quotas", {"rpm": BIG}, "rpm"),
        ("PUT", f"/admin/api/tenants/{tid}/quotas", {"max_concurrent": 2**31}, "max_concurrent"),
        ("PUT", f"/admin/api/tenants/{tid}/quotas", {"max_adapter_bytes": BIG}, "max_adapter_bytes"),
        ("POST", "/admin/api/tenants", {"name": "big-quota", "quotas": {"tpm": BIG}}, "quotas.tpm"),
        ("POST", f"/admin/api/tenants/{tid}/keys", {"label": "x" * 65}, "label"),
    ]:
        headers = auth(tenant) if path.startswith("/v1") else ADMIN
        assert_error(client.request(method, path, json=body, headers=headers), 400, param=param)
    r = client.get(f"/admin/api/usage/export?cursor={BIG}", headers=ADMIN)
    assert_error(r, 400, param="cursor")
    r = client.get("/admin/api/usage/export?cursor=%C2%B2", headers=ADMIN)  # "²" is a digit to str.isdigit
    assert_error(r, 400, param="cursor")
    body = {"model": f"x@{BIG}", "prompt": "hi", "max_tokens": 1}
    assert_error(client.post("/v1/completions", json=body, headers=auth(tenant)), 404, code="model_not_found")


@pytest.mark.parametrize("value", ["inf", "-inf", "1e300", "-1e300", "nan", "1e20"])
def test_usage_times_out_of_range_are_400(client: TestClient, tenant: dict[str, Any], value: str) -> None:
    assert_error(client.get(f"/v1/usage?start={value}", headers=auth(tenant)), 400, param="start")
    assert_error(client.get(f"/admin/api/usage?end={value}", headers=ADMIN), 400, param="end")


@pytest.mark.parametrize(
    "raw", [b"{not json", b'{"model": "tiny-llama", "prompt": "hi"', b"", b"[]", b"null", b'"text"']
)
def test_bodies_that_are_not_json_objects_are_400(
    client: TestClient, tenant: dict[str, Any], raw: bytes
) -> None:
    headers = {**auth(tenant), "content-type": "application/json"}
    error = assert_error(client.post("/v1/chat/completions", content=raw, headers=headers), 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    r = client.put(f"/admin/api/tenants/{'0' * 32}/quotas", content=raw, headers={**headers, **ADMIN})
    assert_error(r, 400)


def test_openapi_lists_the_statuses_routes_return(client: TestClient, tenant: dict[str, Any]) -> None:
    doc = client.get("/openapi.json").json()
    operations = {
        (method.upper(), path): op for path, ops in doc["paths"].items() for method, op in ops.items()
    }
    for (method, path), op in operations.items():
        statuses = set(op["responses"])
        assert "422" not in statuses, (method, path)  # invalid input is 400 here
        assert {"500", "503"} <= statuses, (method, path)  # any route: a bug, or a dependency down
        for status in statuses - {"200", "201"}:
            schema = op["responses"][status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    # Statuses this module and the issue provoke, each documented on its route.
    provoked = {
        ("POST", "/v1/completions"): {"400", "401", "404", "429", "503", "504"},
        ("POST", "/v1/chat/completions"): {"400", "401", "404", "429", "503", "504"},
        ("DELETE", "/v1/adapters/{name}"): {"400", "401", "404"},
        ("POST", "/v1/adapters"): {"400", "401", "413", "429", "503"},
        ("GET", "/v1/usage"): {"400", "401", "503"},
        ("GET", "/admin/api/usage/export"): {"400", "401", "503"},
        ("PUT", "/admin/api/tenants/{tenant_id}/quotas"): {"400", "401", "404"},
        ("GET", "/admin/api/audit"): {"400", "401"},
    }
    for route, statuses in provoked.items():
        assert statuses <= set(operations[route]["responses"]), (route, operations[route]["responses"].keys())


def _upload(client: TestClient, tenant: dict[str, Any], name: str, files: dict[str, bytes]) -> Any:
    parts = [("files", (fname, content, "application/octet-stream")) for fname, content in files.items()]
    return client.post("/v1/adapters", headers=auth(tenant), data={"name": name}, files=parts)


def _nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * depth + b"]" * depth + b"}"


def test_deeply_nested_json_in_an_upload_is_400(
    client: TestClient, tenant: dict[str, Any], tmp_path: Path
) -> None:
    files = files_of(peft_adapter(tmp_path / "a"))
    for depth in (100, 100_000):  # under the recursion limit (repr breaks later) and far past it
        config = json.loads(files[CONFIG])
        nested = {
            **files,
            CONFIG: json.dumps(config)[:-1].encode() + b', "runtime_config": ' + _nested(depth) + b"}",
        }
        error = assert_error(_upload(client, tenant, f"nest-c{depth}", nested), 400, code="invalid_adapter")
        assert "nests deeper" in error["message"]
        header = _nested(depth)
        weights = len(header).to_bytes(8, "little") + header
        error = assert_error(
            _upload(client, tenant, f"nest-w{depth}", {**files, WEIGHTS: weights}),
            400,
            code="invalid_adapter",
        )
        assert "nests deeper" in error["message"]
    assert _upload(client, tenant, "nest-ok", files).status_code == 201  # the server is fine after


def _leaks(text: str, state: AppState, tenant: dict[str, Any]) -> list[str]:
    data_dir = str(state.settings.data_dir.resolve())
    found = [s for s in (data_dir, str(state.settings.data_dir), tenant["id"], "/tmp/") if s in text]
    return found + re.findall(r"[a-z][a-z0-9+.-]*://\S+|sha256/[0-9a-f]{8}", text)


def test_error_bodies_name_no_path_url_or_internal_id(
    client: TestClient, tenant: dict[str, Any], app_state: tuple[FastAPI, AppState], tmp_path: Path
) -> None:
    state = app_state[1]
    files = files_of(peft_adapter(tmp_path / "b"))
    bodies = [
        _upload(client, tenant, "only-config", {CONFIG: files[CONFIG]}).text,  # validator names its dir
        _upload(client, tenant, "only-weights", {WEIGHTS: files[WEIGHTS]}).text,
        _upload(client, tenant, "pickle", {CONFIG: files[CONFIG], "adapter_model.bin": b"x"}).text,
    ]
    for body in bodies:
        assert json.loads(body)["error"]["message"]
        assert _leaks(body, state, tenant) == [], body


def test_redact_removes_paths_urls_and_ids() -> None:
    from api.errors import redact

    tenant_id = uuid.uuid4().hex
    message = (
        f"adapter '{tenant_id}/bot@1' cannot be served: cannot reach S3 endpoint http://10.0.0.5:9000 "
        "(get s3://bucket/registry/sha256/" + "ab" * 32 + "): adapter_model.safetensors is missing in "
        "/srv/loraserve-data/adapter-cache/.tmp-1"
    )
    cleaned = redact(message)
    for secret in (tenant_id, "10.0.0.5", "s3://", "ab" * 32, "/srv/", "loraserve-data"):
        assert secret not in cleaned, cleaned
    assert "adapter_model.safetensors is missing" in cleaned and "bot@1" in cleaned
    # What callers write themselves stays readable.
    for kept in (
        "The model `org/model-v1` does not exist or you do not have access to it.",
        "quota max_adapters exceeded: 3 > 2",
        "Incorrect API key provided: invalid API key lsk-1a2b3c4d-...",
        "group_by must be day|adapter|key, rpm/tpm",
    ):
        assert redact(kept) == kept


def test_console_quota_form_refuses_what_the_columns_cannot_hold() -> None:
    from api.admin.console.service import parse_quotas
    from api.errors import APIError
    from registry.types import TenantQuotas

    for name, raw in (("rpm", str(2**31)), ("max_adapter_bytes", str(BIG)), ("tpm", "²")):
        with pytest.raises(APIError) as info:
            parse_quotas({name: raw})
        assert info.value.status == 400 and info.value.param == name
    with pytest.raises(ValueError, match="max_concurrent"):
        TenantQuotas(max_concurrent=2**31)
    assert parse_quotas({"max_adapter_bytes": str(BIG - 1)}).max_adapter_bytes == BIG - 1


def test_a_text_too_long_for_any_encoding_is_refused_before_it_is_encoded(
    client: TestClient, tenant: dict[str, Any], app_state: tuple[FastAPI, AppState], monkeypatch: Any
) -> None:
    """base_engine/model/token_bound.py: the tokenizer never sees a text that cannot fit (SmolLM2's took ~11 s
    of CPU for the 8 MiB a body may hold); one that might fit is encoded and judged as before."""
    state = app_state[1]
    tokenizer, limit = state.tokenizer, state.max_model_len
    encoded: list[int] = []
    real_encode = tokenizer.encode
    monkeypatch.setattr(
        tokenizer, "encode", lambda *a, **k: encoded.append(len(a[0])) or real_encode(*a, **k)
    )
    bound = max_chars_per_token(tokenizer)
    assert bound is not None
    text = "x" * (bound * limit + 1)
    chat = [{"role": "user", "content": text}]
    cases = [
        ("/v1/completions", {"model": BASE, "prompt": text, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": BASE, "prompt": ["hi", text], "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"model": BASE, "messages": chat, "max_tokens": 1}, "messages"),
        ("/tokenize", {"model": BASE, "prompt": text}, "prompt"),
        ("/tokenize", {"model": BASE, "messages": chat}, "messages"),
    ]
    for path, body, param in cases:
        r = client.post(path, json=body, headers=auth(tenant))
        error = assert_error(r, 400, param=param, code="context_length_exceeded")
        assert f"maximum context length is {limit} tokens" in error["message"]
        what = (
            f"the prompt is {len(text)}"
            if param == "prompt"
            else r"the chat as its template renders it is \d+"
        )
        assert re.search(f"{what} characters long, which is at least", error["message"]), error
    assert encoded == []
    # At the bound itself the text might fit: it is encoded, and refused for its real token count.
    r = client.post(
        "/v1/completions", json={"model": BASE, "prompt": text[:-1], "max_tokens": 1}, headers=auth(tenant)
    )
    error = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert "in the prompt, 1 in the completion" in error["message"] and encoded == [len(text) - 1]


def _deep_schema(depth: int) -> str:
    # Built as text: json.dumps itself recurses and cannot write it.
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def test_a_tool_schema_nested_900_deep_is_400_naming_the_limit(
    client: TestClient, tenant: dict[str, Any], app_state: tuple[FastAPI, AppState]
) -> None:
    from api.inference.tools import MAX_TOOL_SCHEMA_DEPTH

    model = app_state[1].model_name
    tool = '{"type": "function", "function": {"name": "f", "parameters": %s}}'
    messages = '[{"role": "user", "content": "hi"}]'
    tools = "[" + tool % _deep_schema(450) + "]"  # 900 JSON levels below `parameters`
    body = f'{{"model": "{model}", "messages": {messages}, "max_tokens": 1, "tools": {tools}}}'
    headers = {**auth(tenant), "Content-Type": "application/json"}
    r = client.post("/v1/chat/completions", content=body, headers=headers)
    error = assert_error(r, 400, param="tools[0].function.parameters", code="invalid_value")
    assert f"limit of {MAX_TOOL_SCHEMA_DEPTH} levels" in error["message"]
    fine = body.replace(_deep_schema(450), _deep_schema(3))
    shallow = client.post("/v1/chat/completions", content=fine, headers=headers)
    # Past the depth check (this tiny model's context may still be too short for the rendered tools).
    assert shallow.status_code == 200 or shallow.json()["error"]["code"] == "context_length_exceeded"


def test_an_upload_with_an_integer_alpha_beyond_the_float_range_is_400(
    client: TestClient, tenant: dict[str, Any], tmp_path: Path
) -> None:
    files = files_of(peft_adapter(tmp_path / "alpha"))
    config = json.loads(files[CONFIG])
    hostile = {**files, CONFIG: json.dumps({**config, "lora_alpha": 2**1100}).encode()}
    error = assert_error(_upload(client, tenant, "huge-alpha", hostile), 400, code="invalid_adapter")
    assert "lora_alpha" in error["message"] and "limit of 1.798e+308" in error["message"]
    listing = client.get("/v1/adapters", headers=auth(tenant)).json()["data"]
    assert "huge-alpha" not in {a["name"] for a in listing}  # nothing left behind
    assert _upload(client, tenant, "huge-alpha", files).status_code == 201  # the name is still free
