"""Fleet membership service functions: heartbeats, the replica list, pins, fleet events.

Every function is keyword-only and one transaction (`transactional`), like the rest of the registry.
Admin actions that touch residency (`pin_adapter`, `unpin_adapter`, `delete_adapter`,
`set_tenant_status`) make their change and append their `fleet_events` row in the same transaction:
either every replica hears of a committed change or the change did not happen. They reuse the
single-process registry functions' bodies (`fn.__wrapped__`, the function `transactional` wraps), so
the rules (resolution, 404s, what deleting a tenant revokes) stay in one place.

Pins are state (`fleet_pins`): `pins_in_force` is what a replica should hold pinned now, whatever
events it missed. `stale_refs` answers which of a replica's resident adapters may no longer be served.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from registry import adapters as adapter_fns
from registry import tenants as tenant_fns
from registry.db import transactional
from registry.fleet_models import FleetEvent, FleetEventKind, FleetPin, FleetReplica, ReplicaState
from registry.models import AdapterStatus, AdapterVersion, Tenant, TenantStatus, utcnow
from registry.types import AdapterVersionInfo, TenantInfo

MAX_EVENTS_PER_POLL = 500


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    replica_id: str
    host: str
    pid: int
    started_at: datetime
    last_seen: datetime
    state: str  # ReplicaState value, or "lost" when silent for longer than the reader's bound
    stats: dict[str, Any]
    residency: dict[str, Any]
    metrics_at: datetime | None


@dataclass(frozen=True, slots=True)
class FleetEventInfo:
    id: int
    kind: str  # FleetEventKind value
    tenant_id: str | None
    payload: dict[str, Any]
    created_at: datetime

    @property
    def ref_ids(self) -> tuple[str, ...]:
        return tuple(self.payload.get("ref_ids", ()))


def _event_info(row: FleetEvent) -> FleetEventInfo:
    return FleetEventInfo(row.id, row.kind, row.tenant_id, dict(row.payload or {}), row.created_at)


# ---- replicas --------------------------------------------------------------------------------


@transactional
def heartbeat(
    session: Session,
    *,
    replica_id: str,
    host: str,
    pid: int,
    state: ReplicaState,
    stats: dict[str, Any],
    residency: dict[str, Any],
    metrics: str | None = None,
) -> None:
    """Insert or refresh this replica's row; `metrics` (an exposition) is kept only when given."""
    if not replica_id or len(replica_id) > 128:
        raise ValueError(f"replica id must be 1-128 characters, got {replica_id!r}")
    now = utcnow()
    row = session.get(FleetReplica, replica_id)
    if row is None or row.pid != pid or row.host != host:
        # A new process under a reused id (a restart): it starts afresh, its start time too.
        if row is not None:
            session.delete(row)
            session.flush()
        row = FleetReplica(replica_id=replica_id, host=host, pid=pid, started_at=now)
        session.add(row)
    row.last_seen, row.state, row.stats, row.residency = now, ReplicaState(state).value, stats, residency
    if metrics is not None:
        row.metrics, row.metrics_at = metrics, now


@transactional
def remove_replica(session: Session, *, replica_id: str) -> bool:
    """A clean shutdown: the replica leaves the fleet (True when it had a row)."""
    return session.execute(delete(FleetReplica).where(FleetReplica.replica_id == replica_id)).rowcount > 0


def _state(row: FleetReplica, lost_before: datetime) -> str:
    return "lost" if row.last_seen < lost_before else row.state


@transactional
def list_replicas(session: Session, *, lost_after_s: float) -> list[ReplicaInfo]:
    """Every replica with a row, oldest first; silent for more than `lost_after_s` -> state "lost"."""
    if lost_after_s <= 0:
        raise ValueError(f"lost_after_s must be > 0, got {lost_after_s}")
    lost_before = utcnow() - timedelta(seconds=lost_after_s)
    rows = session.scalars(select(FleetReplica).order_by(FleetReplica.started_at, FleetReplica.replica_id))
    return [
        ReplicaInfo(
            replica_id=r.replica_id,
            host=r.host,
            pid=r.pid,
            started_at=r.started_at,
            last_seen=r.last_seen,
            state=_state(r, lost_before),
            stats=dict(r.stats or {}),
            residency=dict(r.residency or {}),
            metrics_at=r.metrics_at,
        )
        for r in rows
    ]


@transactional
def replica_metrics(session: Session, *, lost_after_s: float) -> list[tuple[str, str]]:
    """(replica id, latest exposition) of every replica heard from within `lost_after_s`."""
    lost_before = utcnow() - timedelta(seconds=lost_after_s)
    query = (
        select(FleetReplica.replica_id, FleetReplica.metrics)
        .where(FleetReplica.last_seen >= lost_before, FleetReplica.metrics.is_not(None))
        .order_by(FleetReplica.replica_id)
    )
    return [(replica_id, text) for replica_id, text in session.execute(query)]


@transactional
def prune_replicas(session: Session, *, silent_for_s: float) -> int:
    """Forget rows of replicas silent for longer than `silent_for_s` (long after they showed "lost")."""
    cutoff = utcnow() - timedelta(seconds=silent_for_s)
    return session.execute(delete(FleetReplica).where(FleetReplica.last_seen < cutoff)).rowcount


# ---- events ----------------------------------------------------------------------------------


def append_event(
    session: Session, *, kind: FleetEventKind, tenant_id: str | None, payload: dict[str, Any]
) -> FleetEventInfo:
    """Add an event to the caller's transaction (not one of its own: it commits with the change)."""
    row = FleetEvent(kind=FleetEventKind(kind).value, tenant_id=tenant_id, payload=payload)
    session.add(row)
    session.flush()
    return _event_info(row)


@transactional
def events_after(
    session: Session, *, after_id: int, limit: int = MAX_EVENTS_PER_POLL
) -> list[FleetEventInfo]:
    """Events with id > `after_id`, oldest first, at most `limit`."""
    query = select(FleetEvent).where(FleetEvent.id > after_id).order_by(FleetEvent.id).limit(limit)
    return [_event_info(row) for row in session.scalars(query)]


@transactional
def latest_event_id(session: Session) -> int:
    """Where a starting replica begins polling (0: no events yet); it catches up from state instead."""
    return int(session.scalar(select(func.coalesce(func.max(FleetEvent.id), 0))) or 0)


@transactional
def prune_events(session: Session, *, older_than_s: float) -> int:
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    return session.execute(delete(FleetEvent).where(FleetEvent.created_at < cutoff)).rowcount


# ---- admin actions: the change and its event in one transaction --------------------------------


@transactional
def pin_adapter(session: Session, *, tenant_id: str, model: str) -> AdapterVersionInfo:
    """Pin the version `model` names ("bot" = latest ready, "bot@2") on every replica."""
    info = adapter_fns.resolve_adapter.__wrapped__(session, tenant_id=tenant_id, model=model)
    key = (info.tenant_id, info.name, info.version)
    if session.get(FleetPin, key) is None:
        session.add(FleetPin(tenant_id=info.tenant_id, name=info.name, version=info.version))
    append_event(session, kind=FleetEventKind.PIN, tenant_id=tenant_id, payload={"ref_ids": [info.ref_id]})
    return info


@transactional
def unpin_adapter(session: Session, *, tenant_id: str, model: str) -> AdapterVersionInfo:
    info = adapter_fns.resolve_adapter.__wrapped__(session, tenant_id=tenant_id, model=model)
    session.execute(
        delete(FleetPin).where(
            FleetPin.tenant_id == info.tenant_id, FleetPin.name == info.name, FleetPin.version == info.version
        )
    )
    append_event(session, kind=FleetEventKind.UNPIN, tenant_id=tenant_id, payload={"ref_ids": [info.ref_id]})
    return info


@transactional
def delete_adapter(
    session: Session, *, tenant_id: str, name: str, version: int | None = None
) -> list[AdapterVersionInfo]:
    """Soft-delete as `registry.adapters.delete_adapter`, drop the versions' pins, tell every replica."""
    deleted = adapter_fns.delete_adapter.__wrapped__(session, tenant_id=tenant_id, name=name, version=version)
    versions = [d.version for d in deleted]
    session.execute(
        delete(FleetPin).where(
            FleetPin.tenant_id == tenant_id, FleetPin.name == name, FleetPin.version.in_(versions)
        )
    )
    payload = {"ref_ids": [d.ref_id for d in deleted]}
    append_event(session, kind=FleetEventKind.ADAPTER_DELETE, tenant_id=tenant_id, payload=payload)
    return deleted


_STATUS_EVENTS = {
    TenantStatus.SUSPENDED: FleetEventKind.TENANT_SUSPEND,
    TenantStatus.ACTIVE: FleetEventKind.TENANT_ACTIVATE,
    TenantStatus.DELETED: FleetEventKind.TENANT_DELETE,
}


@transactional
def set_tenant_status(session: Session, *, tenant_id: str, status: str | TenantStatus) -> TenantInfo:
    """As `registry.tenants.set_tenant_status`; a deleted tenant's pins go; every replica hears of it.
    A suspended tenant keeps its pins in the table (not in force while suspended) for reactivation."""
    info = tenant_fns.set_tenant_status.__wrapped__(session, tenant_id=tenant_id, status=status)
    new = TenantStatus(info.status)
    if new == TenantStatus.DELETED:
        session.execute(delete(FleetPin).where(FleetPin.tenant_id == tenant_id))
    append_event(session, kind=_STATUS_EVENTS[new], tenant_id=tenant_id, payload={})
    return info


# ---- what a replica should hold ----------------------------------------------------------------


@transactional
def pins_in_force(session: Session) -> list[AdapterVersionInfo]:
    """Pinned versions that are still ready, of active tenants: what every replica keeps pinned."""
    query = (
        select(AdapterVersion)
        .join(
            FleetPin,
            (FleetPin.tenant_id == AdapterVersion.tenant_id)
            & (FleetPin.name == AdapterVersion.name)
            & (FleetPin.version == AdapterVersion.version),
        )
        .join(Tenant, Tenant.id == AdapterVersion.tenant_id)
        .where(AdapterVersion.status == AdapterStatus.READY.value, Tenant.status == TenantStatus.ACTIVE.value)
        .order_by(FleetPin.pinned_at)
    )
    return [AdapterVersionInfo.from_row(row) for row in session.scalars(query)]


def parse_ref_id(ref_id: str) -> tuple[str, str, int] | None:
    """ "<tenant>/<name>@<version>" -> (tenant, name, version); None for ids of another form."""
    tenant_id, slash, rest = ref_id.partition("/")
    name, at, version = rest.rpartition("@")
    if not (slash and at and tenant_id and name and version.isdigit()):
        return None
    return tenant_id, name, int(version)


@transactional
def stale_refs(session: Session, *, ref_ids: list[str]) -> set[str]:
    """Of these engine adapter ids, the ones that may no longer be served (version deleted or gone,
    tenant not active): a replica evicts them, whichever event it missed. Other ids are left alone."""
    parsed = {ref_id: key for ref_id in ref_ids if (key := parse_ref_id(ref_id)) is not None}
    if not parsed:
        return set()
    query = (
        select(AdapterVersion.tenant_id, AdapterVersion.name, AdapterVersion.version)
        .join(Tenant, Tenant.id == AdapterVersion.tenant_id)
        .where(
            AdapterVersion.tenant_id.in_({t for t, _, _ in parsed.values()}),
            AdapterVersion.status == AdapterStatus.READY.value,
            Tenant.status == TenantStatus.ACTIVE.value,
        )
    )
    servable = {tuple(row) for row in session.execute(query)}
    return {ref_id for ref_id, key in parsed.items() if key not in servable}
