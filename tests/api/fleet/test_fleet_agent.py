"""The replica agent and the fleet read models in process: a real app (tiny Llama, SQLite, LocalStore).

What another replica's admin would write is written here with the registry's fleet functions; the
oracle is this replica's own adapter cache (`engine.lora.cache`) after one agent beat (`tick()`).
Also: the `replica` label on every /metrics series, merging several replicas' expositions, the
single-process fleet view, and a hung database that ends a beat within the agent's own timeouts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from api.fleet.agent import ReplicaAgent
from api.fleet.views import merge_expositions
from api.metrics.prometheus import Metrics
from api.state import AppState
from migrations.api import upgrade
from registry import fleet
from registry.adapters import delete_adapter
from registry.db import make_engine, session_factory
from tests.api.admin.console_helpers import admin_api, browser, console_app, login, peft_adapter
from tests.harness.hanging_proxy import HangingProxy
from tests.harness.wait import wait_for


@pytest.fixture(scope="module")
def started(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FastAPI, AppState]]:
    with console_app(tiny_llama_dir, tmp_path_factory.mktemp("agent")) as app_and_state:
        yield app_and_state


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop of the agent's own (the app's runs inside TestClient's portal)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def agent_of(state: AppState, loop: asyncio.AbstractEventLoop, replica_id: str = "solo") -> ReplicaAgent:
    replica = dataclasses.replace(state.replica, replica_id=replica_id)
    return ReplicaAgent(replica, metrics=state.metrics, loop=loop, sessions=state.sessions)


def uploaded(app: FastAPI, tiny_llama_dir: Path, tmp: Path, name: str) -> tuple[str, str]:
    """(tenant id, engine ref id) of a new tenant's adapter uploaded through the API."""
    tenant = admin_api(app, "POST", "/tenants", json={"name": f"a-{name}-{time.monotonic_ns() % 10**8}"})
    files = peft_adapter(tiny_llama_dir, tmp / name, rank=4)
    parts = [
        ("files", (f, (files / f).read_bytes())) for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    r = browser(app).post(
        "/v1/adapters",
        data={"name": name},
        files=parts,
        headers={"Authorization": f"Bearer {tenant['api_key']}"},
    )
    assert r.status_code == 201, r.text
    return tenant["id"], f"{tenant['id']}/{name}@1"


def pinned(state: AppState) -> set[str]:
    """The engine's pins as of its last step (read from its stats: never the cache from this thread)."""
    return set(state.engine.stats().adapters.pinned)


def resident(state: AppState) -> set[str]:
    return set(state.engine.adapter_residency())


def test_events_and_state_drive_this_replicas_cache(
    started: tuple[FastAPI, AppState], loop: asyncio.AbstractEventLoop, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    app, state = started
    agent = agent_of(state, loop)
    agent.tick()  # joins: heartbeat, cursor at the latest event
    assert agent.cursor is not None
    tenant_id, ref_id = uploaded(app, tiny_llama_dir, tmp_path, "bot")
    with state.sessions() as session:
        info = fleet.pin_adapter(session, tenant_id=tenant_id, model="bot")  # as another replica's admin
    time.sleep(0.2)
    assert ref_id not in pinned(state)  # nothing happens here before the agent's beat
    agent.tick()
    wait_for(lambda: ref_id in pinned(state) and ref_id in resident(state), 20.0)  # the pin loads it

    late = agent_of(state, loop, "late")  # a replica started later: no events, only state
    asyncio.run_coroutine_threadsafe(state.engine.unpin_adapter(info.ref), loop).result(10)
    wait_for(lambda: ref_id not in pinned(state), 20.0)
    late.tick()
    wait_for(lambda: ref_id in pinned(state), 20.0)

    with state.sessions() as session:
        fleet.delete_adapter(session, tenant_id=tenant_id, name="bot")
    agent.tick()
    wait_for(lambda: ref_id not in pinned(state) and ref_id not in resident(state), 20.0)
    with state.sessions() as session:
        replicas = {r.replica_id: r for r in fleet.list_replicas(session, lost_after_s=60)}
    assert {"solo", "late"} <= set(replicas) and replicas["solo"].state == "ready"
    assert replicas["late"].residency["pinned"] == []  # its beat came before it pinned


def test_stale_residency_is_evicted_without_any_event(
    started: tuple[FastAPI, AppState], loop: asyncio.AbstractEventLoop, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A delete whose event this replica never saw (here: made by the single-process function)."""
    app, state = started
    tenant_id, ref_id = uploaded(app, tiny_llama_dir, tmp_path, "quiet")
    with state.sessions() as session:
        fleet.pin_adapter(session, tenant_id=tenant_id, model="quiet")
    agent = agent_of(state, loop)
    agent.tick()
    wait_for(lambda: ref_id in resident(state), 20.0)
    with state.sessions() as session:
        delete_adapter(session, tenant_id=tenant_id, name="quiet")  # no fleet event
    agent.tick()  # events only: nothing to apply
    time.sleep(0.2)
    assert ref_id in resident(state)
    agent.cursor = None  # the next beat reconciles, as every RECONCILE_EVERY beats
    agent.tick()
    wait_for(lambda: ref_id not in resident(state) and ref_id not in pinned(state), 20.0)


def test_a_hung_database_ends_a_beat_within_the_agents_timeout(
    started: tuple[FastAPI, AppState], loop: asyncio.AbstractEventLoop, postgres_db_url: str
) -> None:
    _, state = started
    upgrade(postgres_db_url)
    host_port = postgres_db_url.split("@", 1)[1].split("/", 1)[0]
    with HangingProxy(host_port) as proxy:
        proxy.hang()
        url = postgres_db_url.replace(host_port, proxy.url.removeprefix("http://"))
        engine = make_engine(url, timeout_s=2.0)
        agent = ReplicaAgent(
            dataclasses.replace(state.replica, replica_id="cut-off"),
            metrics=state.metrics,
            loop=loop,
            sessions=session_factory(engine),
        )
        began = time.monotonic()
        agent.tick()  # never raises: serving must go on
        assert time.monotonic() - began < 2.0 + 3
        assert agent.cursor is None and agent.num_beats == 0
        engine.dispose()


def test_replica_label_on_every_series_and_expositions_merge() -> None:
    metrics = {rid: Metrics(model_name="m") for rid in ("r1", "r2")}
    plain = metrics["r1"].render(include_tenants=True)[0].decode()
    assert "replica=" not in plain  # single process: unchanged
    texts = []
    for rid, m in metrics.items():
        m.replica = rid
        text = m.render(include_tenants=True)[0].decode()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert samples and all(s.labels["replica"] == rid for s in samples)
        texts.append(text)
    merged = merge_expositions(texts).decode()
    assert merged.count("# TYPE vllm:num_requests_running gauge") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    running = families["vllm:num_requests_running"]
    assert sorted(s.labels["replica"] for s in running.samples) == ["r1", "r2"]


def test_single_process_fleet_view_and_console_page(started: tuple[FastAPI, AppState]) -> None:
    app, state = started
    view = admin_api(app, "GET", "/fleet")
    assert view["is_fleet"] is False and len(view["data"]) == 1
    (me,) = view["data"]
    assert me["state"] == "ready" and me["stats"]["num_adapter_slots"] == state.settings.max_loras
    client = browser(app)
    login(client)
    page = client.get("/admin/fleet")
    assert page.status_code == 200 and f'data-replica="{me["id"]}"' in page.text
    assert 'href="/admin/fleet"' in page.text  # in the navigation


def test_stop_leaves_the_fleet(started: tuple[FastAPI, AppState], loop: asyncio.AbstractEventLoop) -> None:
    """What a clean shutdown runs (a drain hook): the thread ends and the replica's row goes."""
    _, state = started
    agent = agent_of(state, loop, "leaving")
    agent.start()

    def listed() -> set[str]:
        with state.sessions() as session:
            return {r.replica_id for r in fleet.list_replicas(session, lost_after_s=60)}

    wait_for(lambda: "leaving" in listed(), 20.0)
    asyncio.run_coroutine_threadsafe(agent.stop(), loop).result(30)
    assert "leaving" not in listed() and not agent._thread.is_alive()
