"""A client's `X-Request-Id` through the fleet, without a Ray cluster: the ingress's router (on the
replicas' registry) makes it the request id, and two replicas' apps (real engines, one shared SQLite
registry and usage table) answer it through `serve_assigned`, as `LoraReplica.handle` does. The
request id, the echoed header and the usage record are the client's; the ingress's retry on the other
replica (the first one's answer lost) is billed under the same id once; a request that is not a retry
and reuses the id is a 409; a malformed id is the replica's 400."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from api.context import AssignedId
from api.fleet.asgi_bridge import HttpRequest, ResponseStart
from api.fleet.proxy_headers import with_client_request_id
from api.fleet.replica import serve_assigned
from api.fleet.routing import AdapterRouter, InFlightIds, Route
from registry.tenants import create_tenant
from registry.usage import export_usage
from tests.harness.in_process import request_meter
from tests.harness.replica_apps import ReplicaApp, replica_apps

pytestmark = pytest.mark.slow


@dataclass
class Fleet:
    loop: asyncio.AbstractEventLoop
    replicas: list[ReplicaApp]
    router: AdapterRouter

    def send(
        self, replica: int, route: Route, headers: dict[str, str], body: dict, *, is_retry: bool = False
    ) -> tuple[int, dict, dict]:
        """(status, headers, JSON body) of replica `replica`'s answer with the route's assigned id."""
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        raw.append((b"content-type", b"application/json"))
        request = HttpRequest("POST", "/v1/chat/completions", b"", raw, json.dumps(body).encode())
        assigned = AssignedId(route.request_id, is_retry=is_retry) if route.request_id else None

        async def run() -> list[object]:
            app, extra = self.replicas[replica].app, [(b"x-replica", str(replica).encode())]
            return [c async for c in serve_assigned(app, request, assigned, extra)]

        start, *chunks = self.loop.run_until_complete(run())
        assert isinstance(start, ResponseStart)
        return start.status, {k.decode(): v.decode() for k, v in start.headers}, json.loads(b"".join(chunks))


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet-rid")
    loop = asyncio.new_event_loop()
    try:
        with replica_apps(
            loop, tmp, ("a", "b"),
            model=tiny_llama_dir, served_model_name="tiny-llama", admin_key="lsa-fleet-rid",
            num_kv_blocks=64, max_model_len=128,
        ) as replicas:  # fmt: skip
            yield Fleet(loop, replicas, AdapterRouter(replicas[0].state.sessions, base_model="tiny-llama"))
    finally:
        loop.close()


def _tenant(fleet: Fleet) -> tuple[str, str]:
    with fleet.replicas[0].state.sessions() as session:
        tenant, key = create_tenant(session, name=f"rid-{uuid.uuid4().hex[:8]}")
    return tenant.id, key


def _billed(fleet: Fleet, tenant_id: str, request_id: str) -> list[object]:
    for replica in fleet.replicas:
        request_meter(replica.state).flush()
    with fleet.replicas[0].state.sessions() as session:
        records = export_usage(session, tenant_id=tenant_id, limit=1000).records
    return [r for r in records if r.request_id == request_id]


def _at_ingress(headers: dict[str, str]) -> dict[str, str]:
    """The headers as the ingress sees them behind Ray's proxy and our proxy middleware."""
    raw = with_client_request_id([(k.lower().encode(), v.encode()) for k, v in headers.items()])
    return {k.decode(): v.decode() for k, v in raw} | {"x-request-id": "ray-assigned-uuid"}


def _route(fleet: Fleet, headers: dict[str, str]) -> Route:
    return fleet.router.route("POST", "/v1/chat/completions", _at_ingress(headers), json.dumps(BODY).encode())


BODY = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_client_id_is_the_fleets_request_id_and_a_retry_bills_once(fleet: Fleet) -> None:
    tenant_id, key = _tenant(fleet)
    rid = f"trace:{uuid.uuid4().hex[:12]}.span_1-a"
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": rid}
    route = _route(fleet, headers)
    assert route.request_id == f"chatcmpl-{rid}" and route.client_id == rid and route.tenant_id == tenant_id
    status, got_headers, body = fleet.send(0, route, headers, BODY)
    assert status == 200, body
    assert body["id"] == f"chatcmpl-{rid}" and got_headers["x-request-id"] == rid
    assert len(_billed(fleet, tenant_id, body["id"])) == 1
    # Replica 0's answer is lost on the way: the ingress sends it again to replica 1, marked a retry.
    status, got_headers, again = fleet.send(1, route, headers, BODY, is_retry=True)
    assert status == 200, again
    assert again["id"] == body["id"] and got_headers["x-request-id"] == rid
    (record,) = _billed(fleet, tenant_id, body["id"])  # one record under the client's id
    assert record.tenant_id == tenant_id
    # The client reusing it (not a retry) on either replica: refused by name.
    for replica in (0, 1):
        status, got_headers, refused = fleet.send(replica, route, headers, BODY)
        assert status == 409 and refused["error"]["code"] == "request_id_in_use", refused
        assert rid in refused["error"]["message"]
    # Another tenant may use the same id.
    other_id, other_key = _tenant(fleet)
    other_headers = {"Authorization": f"Bearer {other_key}", "X-Request-Id": rid}
    other = _route(fleet, other_headers)
    assert other.tenant_id == other_id and other.request_id == route.request_id
    status, _, theirs = fleet.send(1, other, other_headers, BODY)
    assert status == 200 and theirs["id"] == f"chatcmpl-{rid}"
    assert len(_billed(fleet, other_id, theirs["id"])) == 1


def test_a_malformed_client_id_is_the_replicas_400(fleet: Fleet) -> None:
    _, key = _tenant(fleet)
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": "has space"}
    route = _route(fleet, headers)
    assert route.client_id is None and route.tenant_id is None and route.request_id.startswith("chatcmpl-")
    status, _, body = fleet.send(0, route, headers, BODY)
    assert status == 400 and body["error"]["code"] == "invalid_request_id", body
    assert body["error"]["param"] == "X-Request-Id"


def test_without_a_client_id_rays_own_is_not_taken_for_one(fleet: Fleet) -> None:
    _, key = _tenant(fleet)
    route = _route(fleet, {"Authorization": f"Bearer {key}"})
    assert route.client_id is None and route.request_id != "chatcmpl-ray-assigned-uuid"


def test_in_flight_ids_are_per_tenant() -> None:
    ids = InFlightIds()
    assert ids.take("t1", "chatcmpl-x") and not ids.take("t1", "chatcmpl-x")
    assert ids.take("t2", "chatcmpl-x")  # another tenant's same id: no conflict
    ids.give_back("t1", "chatcmpl-x")
    assert ids.take("t1", "chatcmpl-x") and len(ids) == 2
