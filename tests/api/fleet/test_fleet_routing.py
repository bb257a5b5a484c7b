"""The fleet's pieces that need no Ray cluster: the ingress's routing identity (on a real SQLite
registry), the replica's in-process ASGI bridge (a real Starlette app), the ingress's request id."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route as StarletteRoute

from adapters.validation import validate_adapter
from api.context import AssignedId, assigned_request_id, new_request_id
from api.fleet.asgi_bridge import HttpRequest, ResponseStart, stream_asgi
from api.fleet.routing import AdapterRouter, parse_model_id
from migrations.api import upgrade
from registry.adapters import register_adapter_version
from registry.db import make_engine, session_factory
from registry.stores import open_store
from registry.tenants import create_tenant
from tests.harness.raw_adapters import BASE_MODEL, SHAPES, write_adapter


@pytest.fixture
def registry(tmp_path: Path) -> tuple[AdapterRouter, str, str]:
    """A router on a migrated SQLite registry with one tenant and its adapter `bot` (version 1)."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    upgrade(url)
    sessions = session_factory(make_engine(url))
    validate = functools.partial(validate_adapter, base=SHAPES, max_lora_rank=16, max_size_bytes=1 << 20)
    with sessions() as session:
        tenant, key = create_tenant(session, name="acme")
        register_adapter_version(
            session, open_store((tmp_path / "objects").as_uri()), tenant_id=tenant.id, name="bot",
            files_dir=write_adapter(tmp_path / "bot"), validate=validate, base_model=BASE_MODEL,
        )  # fmt: skip
    return AdapterRouter(sessions, base_model=BASE_MODEL), tenant.id, key


def _post(router: AdapterRouter, path: str, key: str, model: str):  # noqa: ANN202 - a Route
    body = json.dumps({"model": model, "prompt": "hi"}).encode()
    return router.route("POST", path, {"authorization": f"Bearer {key}"}, body)


def test_routing_identity_is_the_engines_adapter_id(registry: tuple[AdapterRouter, str, str]) -> None:
    router, tenant_id, key = registry
    route = _post(router, "/v1/chat/completions", key, "bot")
    assert route.model_id == f"{tenant_id}/bot@1" and parse_model_id(route.model_id) == (tenant_id, "bot@1")
    assert route.request_id.startswith("chatcmpl-") and route.is_idempotent
    assert _post(router, "/v1/completions", key, "bot@1").model_id == f"{tenant_id}/bot@1"
    assert _post(router, "/tokenize", key, "bot").request_id is None
    assert _post(router, "/v1/responses", key, "bot").model_id == f"{tenant_id}/bot@1"
    # Base model, unknown adapter, bad key, bad JSON: any replica (which answers 404/401/400 itself).
    assert _post(router, "/v1/completions", key, BASE_MODEL).model_id is None
    assert _post(router, "/v1/completions", key, "nope").model_id is None
    assert _post(router, "/v1/completions", "lsk-0000-bad", "bot").model_id is None
    assert router.route("POST", "/v1/completions", {"authorization": f"Bearer {key}"}, b"{").model_id is None


def test_lookups_are_cached_and_non_inference_goes_anywhere(registry: tuple[AdapterRouter, str, str]) -> None:
    router, _, key = registry
    for _ in range(5):
        _post(router, "/v1/completions", key, "bot")
    assert router.num_lookups == 1
    upload = router.route("POST", "/v1/adapters", {"authorization": f"Bearer {key}"}, b"")
    assert upload.model_id is None and upload.request_id is None and not upload.is_idempotent
    assert router.route("GET", "/v1/models", {}, b"").is_idempotent
    router.affinity = False  # the benchmark's baseline: no model id at all
    assert _post(router, "/v1/completions", key, "bot").model_id is None


def test_parse_model_id_names_the_expected_form() -> None:
    with pytest.raises(ValueError, match="'<tenant id>/<adapter>@<version>'"):
        parse_model_id("bot")


def test_assigned_request_id_becomes_the_response_id() -> None:
    token = assigned_request_id.set(AssignedId("cmpl-from-the-ingress"))
    try:
        assert new_request_id("completion") == "cmpl-from-the-ingress"
        assert new_request_id("chat").startswith("chatcmpl-")  # another kind's id is never reused
    finally:
        assigned_request_id.reset(token)
    assert new_request_id("completion") != "cmpl-from-the-ingress"


def _app(events: list[str]) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "q": request.url.query}, headers={"x-a": "1"})

    async def tokens(_: Request) -> StreamingResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                events.append("generator closed")  # what aborts engine requests in api/inference/running.py

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[StarletteRoute("/echo", echo, methods=["POST"]), StarletteRoute("/sse", tokens)])


def test_asgi_bridge_answers_and_streams() -> None:
    async def run() -> list[object]:
        request = HttpRequest("POST", "/echo", b"x=1", [(b"content-type", b"application/json")], b'{"a": 2}')
        return [chunk async for chunk in stream_asgi(_app([]), request)]

    start, body = asyncio.run(run())
    assert isinstance(start, ResponseStart) and start.status == 200 and (b"x-a", b"1") in start.headers
    assert json.loads(body) == {"got": {"a": 2}, "q": "x=1"}


def test_asgi_bridge_caller_gone_disconnects_the_app() -> None:
    events: list[str] = []

    async def run() -> list[object]:
        chunks = []
        stream = stream_asgi(_app(events), HttpRequest("GET", "/sse"))
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                break
        await stream.aclose()  # what Ray's cancellation of the replica's generator amounts to
        return chunks

    chunks = asyncio.run(run())
    assert chunks[1:] == [b"data: 0\n\n", b"data: 1\n\n"]
    assert events == ["generator closed"]


def test_ray_serve_config_is_valid_and_builds() -> None:
    """deploy/ray-serve.yaml passes Ray's own config schema and its args build the application."""
    import yaml

    serve_schema = pytest.importorskip("ray.serve.schema")
    from api.fleet.ray_app import build_app

    config = yaml.safe_load((Path(__file__).parents[3] / "deploy" / "ray-serve.yaml").read_text())
    serve_schema.ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "api.fleet.ray_app:build_app"
    assert {d["name"] for d in app["deployments"]} == {"Ingress", "LoraReplica"}
    build_app(app["args"])
    with pytest.raises(ValueError, match="max_loras"):
        build_app({**app["args"], "max_loras": 0})


@pytest.mark.slow
def test_serve_replicas_refuses_sqlite_and_local_store_naming_each(tmp_path: Path) -> None:
    """`loraserve serve --replicas 2` without PostgreSQL, S3 and an admin key: exit 2 before Ray starts."""
    import os
    import subprocess
    import sys

    loraserve = str(Path(sys.executable).with_name("loraserve"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASERVE_")}
    result = subprocess.run(
        [loraserve, "serve", "--replicas", "2", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    for needed in ("--replicas 2", "PostgreSQL", "s3://", "LORASERVE_ADMIN_KEY"):
        assert needed in result.stderr, result.stderr
    assert not (tmp_path / "data").exists()  # nothing written, no model fetched


def test_a_response_through_rays_proxy_carries_one_request_id() -> None:
    """Ray's proxy wraps every app in its RequestIdMiddleware, which appends its own X-Request-ID even
    when the app set one; our proxy callback's middleware around it keeps only the app's."""
    import httpx
    from ray.serve._private.http_util import RequestIdMiddleware  # what Ray's proxy wraps apps in

    from api.fleet.proxy_headers import CALLBACK, CLIENT_REQUEST_ID, OneRequestId, proxy_env

    def app(headers: dict[str, str]) -> Starlette:
        async def ok(_: Request) -> JSONResponse:
            return JSONResponse({}, headers=headers)

        return Starlette(routes=[StarletteRoute("/", ok)])

    async def ids(asgi: object) -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(asgi), base_url="http://t") as client:
            return (await client.get("/")).headers.get_list("x-request-id")

    ours = {"X-Request-Id": "cmpl-ours"}
    assert asyncio.run(ids(RequestIdMiddleware(app(ours))))[0] == "cmpl-ours"  # and Ray's after it
    assert len(asyncio.run(ids(RequestIdMiddleware(app(ours))))) == 2
    assert asyncio.run(ids(OneRequestId(RequestIdMiddleware(app(ours))))) == ["cmpl-ours"]
    # The client's own X-Request-Id reaches the app as CLIENT_REQUEST_ID; Ray's UUID never does.
    seen: list[dict[str, str]] = []

    async def record(scope: object, receive: object, send: object) -> None:
        seen.append({k.decode(): v.decode() for k, v in scope["headers"]})  # type: ignore[index]
        await app({})(scope, receive, send)  # type: ignore[arg-type]

    async def send_ids(headers: dict[str, str]) -> None:
        transport = httpx.ASGITransport(OneRequestId(RequestIdMiddleware(record)))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await client.get("/", headers=headers)

    asyncio.run(send_ids({"X-Request-Id": "mine", CLIENT_REQUEST_ID: "forged"}))
    asyncio.run(send_ids({CLIENT_REQUEST_ID: "forged"}))
    assert seen[0][CLIENT_REQUEST_ID] == "mine" and CLIENT_REQUEST_ID not in seen[1]
    assert seen[1]["x-request-id"]  # Ray's own, which the router ignores
    assert len(asyncio.run(ids(OneRequestId(RequestIdMiddleware(app({})))))) == 1  # Ray's own stays
    assert proxy_env() == {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK}
