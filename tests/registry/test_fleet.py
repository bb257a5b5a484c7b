"""Fleet membership service functions (registry/fleet.py) on SQLite and PostgreSQL.

Oracles: the registry's own single-process functions (resolution, status) and the rows themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from adapters.types import AdapterSummary
from registry import fleet
from registry.adapters import register_adapter_version, resolve_adapter
from registry.errors import NotFound
from registry.fleet_models import FleetEvent, FleetEventKind, ReplicaState
from registry.models import TenantStatus
from registry.store import ObjectStore
from registry.tenants import create_tenant, get_tenant
from registry.types import AdapterVersionInfo
from tests.harness.raw_adapters import BASE_MODEL, write_adapter

Validate = Callable[[Path], AdapterSummary]


def _adapter(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path, tenant_id: str, name: str
) -> AdapterVersionInfo:
    files = write_adapter(tmp_path / f"{tenant_id}-{name}", seed=hash(name) % 1000)
    return register_adapter_version(
        session,
        local_store,
        tenant_id=tenant_id,
        name=name,
        files_dir=files,
        validate=validate,
        base_model=BASE_MODEL,
    )


def _beat(session: Session, replica_id: str, *, pid: int = 1, **kwargs: object) -> None:
    fleet.heartbeat(
        session,
        replica_id=replica_id,
        host="h",
        pid=pid,
        state=kwargs.pop("state", ReplicaState.READY),  # type: ignore[arg-type]
        stats={"num_running": 0},
        residency=kwargs.pop("residency", {}),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def test_heartbeat_upserts_and_silence_shows_lost(session: Session) -> None:
    _beat(session, "r1", residency={"gpu": ["t/a@1"]})
    _beat(session, "r2", state=ReplicaState.DRAINING)
    first = {r.replica_id: r for r in fleet.list_replicas(session, lost_after_s=60)}
    assert {k: r.state for k, r in first.items()} == {"r1": "ready", "r2": "draining"}
    assert first["r1"].residency == {"gpu": ["t/a@1"]}
    time.sleep(0.3)
    _beat(session, "r1", residency={"cpu": ["t/a@1"]})  # same process: same row, newer last_seen
    again = {r.replica_id: r for r in fleet.list_replicas(session, lost_after_s=0.2)}
    assert again["r1"].state == "ready" and again["r1"].started_at == first["r1"].started_at
    assert again["r1"].residency == {"cpu": ["t/a@1"]} and again["r1"].last_seen > first["r1"].last_seen
    assert again["r2"].state == "lost"  # silent for longer than the bound
    assert fleet.prune_replicas(session, silent_for_s=0.2) == 1
    assert fleet.remove_replica(session, replica_id="r1") is True
    assert fleet.remove_replica(session, replica_id="r1") is False
    assert fleet.list_replicas(session, lost_after_s=60) == []


def test_restart_under_the_same_id_is_a_new_row(session: Session) -> None:
    _beat(session, "r1", pid=10)
    before = fleet.list_replicas(session, lost_after_s=60)[0]
    time.sleep(0.05)
    _beat(session, "r1", pid=11)
    after = fleet.list_replicas(session, lost_after_s=60)
    assert [r.pid for r in after] == [11] and after[0].started_at > before.started_at


def test_bad_replica_ids_and_bounds_are_refused(session: Session) -> None:
    with pytest.raises(ValueError, match="replica id must be 1-128 characters"):
        _beat(session, "x" * 129)
    with pytest.raises(ValueError, match="lost_after_s must be > 0"):
        fleet.list_replicas(session, lost_after_s=0)


def test_metrics_of_live_replicas_only(session: Session) -> None:
    _beat(session, "r1", metrics='up{replica="r1"} 1\n')
    _beat(session, "r2")  # no exposition yet
    assert fleet.replica_metrics(session, lost_after_s=60) == [("r1", 'up{replica="r1"} 1\n')]
    _beat(session, "r1")  # a beat without metrics keeps the last exposition
    assert fleet.replica_metrics(session, lost_after_s=60) == [("r1", 'up{replica="r1"} 1\n')]
    time.sleep(0.3)
    assert fleet.replica_metrics(session, lost_after_s=0.2) == []


def test_pins_are_state_with_an_event_each(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    tenant, _ = create_tenant(session, name="acme")
    bot = _adapter(session, local_store, validate, tmp_path, tenant.id, "bot")
    start = fleet.latest_event_id(session)
    assert fleet.pin_adapter(session, tenant_id=tenant.id, model="bot").ref_id == bot.ref_id
    fleet.pin_adapter(session, tenant_id=tenant.id, model="bot@1")  # twice: still one pin
    assert [p.ref_id for p in fleet.pins_in_force(session)] == [bot.ref_id]
    events = fleet.events_after(session, after_id=start)
    assert [(e.kind, e.ref_ids) for e in events] == [("pin", (bot.ref_id,))] * 2
    assert events[0].id < events[1].id == fleet.latest_event_id(session)
    assert fleet.events_after(session, after_id=events[1].id) == []

    fleet.unpin_adapter(session, tenant_id=tenant.id, model="bot")
    assert fleet.pins_in_force(session) == []
    assert fleet.events_after(session, after_id=events[1].id)[0].kind == "unpin"
    with pytest.raises(NotFound):
        fleet.pin_adapter(session, tenant_id=tenant.id, model="nope")
    assert fleet.pins_in_force(session) == [] and _num_events(session) == 3  # the failure wrote nothing


def _num_events(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(FleetEvent)) or 0)


def test_delete_and_tenant_status_announce_and_unpin(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    tenant, _ = create_tenant(session, name="acme")
    bot = _adapter(session, local_store, validate, tmp_path, tenant.id, "bot")
    other = _adapter(session, local_store, validate, tmp_path, tenant.id, "other")
    for info in (bot, other):
        fleet.pin_adapter(session, tenant_id=tenant.id, model=info.name)
    mark = fleet.latest_event_id(session)

    deleted = fleet.delete_adapter(session, tenant_id=tenant.id, name="bot")
    assert [d.ref_id for d in deleted] == [bot.ref_id]
    with pytest.raises(NotFound):  # the single-process rule: it stops resolving at once
        resolve_adapter(session, tenant_id=tenant.id, model="bot")
    assert [p.ref_id for p in fleet.pins_in_force(session)] == [other.ref_id]
    assert fleet.stale_refs(session, ref_ids=[bot.ref_id, other.ref_id, "/offline/path"]) == {bot.ref_id}

    fleet.set_tenant_status(session, tenant_id=tenant.id, status=TenantStatus.SUSPENDED)
    assert fleet.pins_in_force(session) == []  # not in force while suspended ...
    assert fleet.stale_refs(session, ref_ids=[other.ref_id]) == {other.ref_id}
    fleet.set_tenant_status(session, tenant_id=tenant.id, status="active")
    assert [p.ref_id for p in fleet.pins_in_force(session)] == [other.ref_id]  # ... and back after
    fleet.set_tenant_status(session, tenant_id=tenant.id, status=TenantStatus.DELETED)
    assert get_tenant(session, tenant_id=tenant.id).status == "deleted"
    kinds = [e.kind for e in fleet.events_after(session, after_id=mark)]
    assert kinds == [
        FleetEventKind.ADAPTER_DELETE,
        FleetEventKind.TENANT_SUSPEND,
        FleetEventKind.TENANT_ACTIVATE,
        FleetEventKind.TENANT_DELETE,
    ]
    num_events = _num_events(session)
    with pytest.raises(ValueError, match="tenant status must be one of"):
        fleet.set_tenant_status(session, tenant_id=tenant.id, status="paused")
    assert _num_events(session) == num_events  # a refusal appends nothing


def test_prune_events(session: Session) -> None:
    tenant, _ = create_tenant(session, name="acme")
    fleet.set_tenant_status(session, tenant_id=tenant.id, status="suspended")
    assert fleet.prune_events(session, older_than_s=3600) == 0
    time.sleep(0.05)
    assert fleet.prune_events(session, older_than_s=0.01) == 1
    assert fleet.events_after(session, after_id=0) == []


def test_parse_ref_id() -> None:
    assert fleet.parse_ref_id("abc/bot@12") == ("abc", "bot", 12)
    assert fleet.parse_ref_id("abc/b@t@3") == ("abc", "b@t", 3)
    for other in ("/tmp/x", "bot@1", "abc/bot", "abc/bot@x", "/bot@1"):
        assert fleet.parse_ref_id(other) is None
