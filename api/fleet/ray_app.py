"""The fleet on Ray Serve: one ingress (behind Ray's HTTP proxy) in front of N engine replicas.

`build_app(args)` is the application builder for `serve run` / `serve deploy`
(deploy/ray-serve.yaml) and for `loraserve serve --replicas N` (api/fleet/launch.py). `args` are
`Settings` fields (`db`, `registry`, `model`, `max_loras`, ...; secrets come from `LORASERVE_*`
environment variables, never from args) plus `num_replicas` and `affinity`.

The ingress reads enough to route (api/fleet/routing.py), picks the replica through Ray's router
(the adapter's multiplexed model id for inference; Ray's power-of-two least-loaded choice otherwise)
and streams the replica's answer through. A replica that dies before its first byte: the request is
sent once more to another replica when that is safe (inference keeps its request id, so it is billed
once; GETs), else a 503 with Retry-After. After the first byte a failure ends the stream (SSE: with an
error event), since part of the answer already reached the client.

A client's `X-Request-Id` is the request id through the fleet (api/fleet/routing.py); one its tenant
has in flight through this ingress is a 409 here, one already billed the replica's 409; the retry is
marked (`AssignedId.is_retry`) so the replica bills it under the same id without calling it in use.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from api.context import AssignedId
from api.errors import APIError, request_id_in_use
from api.fleet.asgi_bridge import HttpRequest, ResponseStart
from api.fleet.replica import LoraReplica
from api.fleet.residency_router import residency_router_config
from api.fleet.routing import AdapterRouter, InFlightIds, Route
from api.http.body_limit import STREAMED_UPLOADS, read_body
from api.settings import load_settings
from api.tenant_adapters.uploads import upload_limits
from base_engine.model.config import load_model_config
from registry.db import make_engine, session_factory

logger = logging.getLogger(__name__)

REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
RETRY_AFTER_S = 2


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class Ingress:
    def __init__(self, replica: DeploymentHandle, overrides: dict[str, Any], affinity: bool = True) -> None:
        settings = load_settings(**overrides)
        engine = make_engine(
            settings.db_url,
            timeout_s=settings.db_timeout_s,
        )
        self.router = AdapterRouter(
            session_factory(engine), base_model=settings.model_name, affinity=affinity
        )
        self.replica = replica
        self.in_flight = InFlightIds()
        # The fleet's front door buffers bodies too: the same ceilings as a replica's
        # (api/http/body_limit.py).
        from api.bootstrap import resolve_model

        shapes = load_model_config(resolve_model(settings)).base_shapes()
        self.max_upload_bytes = upload_limits(settings, shapes).body_bytes
        self.max_body_bytes = settings.max_request_body_bytes
        self.body_timeout_s = settings.request_body_timeout_s

    async def __call__(self, request: Request) -> Response:
        is_upload = (request.method, request.url.path) in STREAMED_UPLOADS
        limit = self.max_upload_bytes if is_upload else self.max_body_bytes
        try:
            body = await read_body(request.headers.raw, request.receive, limit, self.body_timeout_s)
        except APIError as exc:
            return exc.response({"Connection": "close"})
        if body is None:  # the client left before sending its body: nobody to answer
            return Response(status_code=499)
        route = await asyncio.to_thread(
            self.router.route, request.method, request.url.path, request.headers, body
        )
        client = (request.client.host, request.client.port) if request.client else None
        http = HttpRequest(
            request.method, request.url.path, request.url.query.encode(), request.headers.raw, body, client
        )
        held = route.tenant_id is not None and route.client_id is not None and route.request_id is not None
        if held and not self.in_flight.take(route.tenant_id, route.request_id):
            return request_id_in_use(route.client_id).response({"X-Request-Id": route.client_id})
        try:
            response = await self.forward(http, route)
        except BaseException:
            if held:
                self.in_flight.give_back(route.tenant_id, route.request_id)
            raise
        if held:
            give_back = functools.partial(self.in_flight.give_back, route.tenant_id, route.request_id)
            if isinstance(response, StreamingResponse):  # free once the body is sent, or the client left
                response.body_iterator = _then(response.body_iterator, give_back)
                response.background = BackgroundTask(give_back)  # a body never started
            else:
                give_back()
        return response

    async def forward(self, http: HttpRequest, route: Route) -> Response:
        attempts = 2 if route.is_idempotent else 1
        for attempt in range(1, attempts + 1):
            is_retry = attempt > 1
            assigned = None if route.request_id is None else AssignedId(route.request_id, is_retry)
            stream: DeploymentResponseGenerator = self.replica.options(
                stream=True, multiplexed_model_id=route.model_id or ""
            ).handle.remote(http, assigned)
            try:
                start = await stream.__anext__()
            except REPLICA_GONE as exc:
                logger.warning("%s %s: replica gone before answering (attempt %d/%d): %s", http.method,
                               http.path, attempt, attempts, exc)  # fmt: skip
                continue
            except Exception:
                logger.exception("%s %s: replica failed", http.method, http.path)
                return APIError(500, "The replica failed to answer; the server logged the cause.").response()
            if not isinstance(start, ResponseStart):
                stream.cancel()
                raise TypeError(f"expected ResponseStart first from the replica, got {type(start).__name__}")
            response = StreamingResponse(_rest(stream, start), status_code=start.status)
            response.raw_headers = list(start.headers)
            return response
        return APIError(
            503,
            "The replica serving this request went away; retry later.",
            code="replica_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ).response()


async def _then(body: AsyncIterator[Any], done: Callable[[], None]) -> AsyncIterator[Any]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        done()


async def _rest(stream: DeploymentResponseGenerator, start: ResponseStart) -> AsyncIterator[bytes]:
    """The body after the start; cancelling it (client disconnect) cancels the replica's request."""
    is_sse = any(
        k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers
    )
    try:
        async for chunk in stream:
            yield chunk
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the replica died mid-answer: end what the client has cleanly
        logger.warning("replica failed mid-response: %s", exc)
        if is_sse:
            error = APIError(503, "The replica serving this stream went away.", code="replica_unavailable")
            yield f"data: {json.dumps(error.body())}\n\n".encode()
    finally:
        stream.cancel()  # a no-op once it finished; else the replica's app sees http.disconnect


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder: `serve run api.fleet.ray_app:build_app db=... registry=...`."""
    args = dict(args)
    num_replicas = int(args.pop("num_replicas", 2))
    affinity = str(args.pop("affinity", "true")).lower() not in ("0", "false", "no")
    num_cpus = float(args.pop("replica_num_cpus", 1))
    settings = load_settings(**args)  # invalid args fail here, naming the field, before anything starts
    routing = {"request_router_config": residency_router_config()} if affinity else {}
    replica = serve.deployment(LoraReplica).options(
        **routing,  # affinity: the replicas' residency series; else Ray's power-of-two (the baseline)
        name="LoraReplica",
        num_replicas=num_replicas,
        max_ongoing_requests=settings.max_num_seqs,  # a full batch: more spills to another replica
        ray_actor_options={"num_cpus": num_cpus},
        health_check_period_s=5,
    )
    return Ingress.bind(replica.bind(args), args, affinity)
