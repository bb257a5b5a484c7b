"""Read models of the fleet for the admin API and the console: replicas with residency, merged metrics.

`fleet_view(session, replica=...)`: in fleet mode every replica's row (state "lost" when silent for
longer than `LOST_AFTER_S`); in single-process mode this one process, built live from the same
snapshot the agent writes, so `GET /admin/api/fleet` and the console's Fleet page have one shape.
Residency names adapters as people do (tenant, `name@version`, tier, pinned): the engine's ids map
to ready versions, disk-tier entries (`<weights sha256>-<config sha256>`) to every version with
those bytes.

`fleet_metrics(session, metrics=..., is_fleet=...)`: Prometheus scrapes each replica's own /metrics;
behind a single HTTP entry point (Ray Serve) a scraper reaches one replica at a time, so each
replica also stores its latest exposition (replica label on every series) with its heartbeat, and
this merges the live replicas' snapshots into one exposition, one family at a time (a text
concatenation would repeat HELP/TYPE lines), plus `loraserve_fleet_replica_up{replica}` (1 live,
0 lost) for every row. Snapshots are at most `METRICS_EVERY` heartbeats old.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from api.fleet.agent import LOST_AFTER_S
from api.fleet.snapshot import ThisReplica
from api.metrics.prometheus import Metrics
from registry import fleet
from registry.adapters import list_adapters
from registry.fleet import ReplicaInfo
from registry.tenants import list_tenants
from registry.types import AdapterVersionInfo

TIER_ORDER = ("gpu", "cpu", "disk")


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def _local_replica(replica: ThisReplica) -> ReplicaInfo:
    snap = replica.snapshot()
    now = datetime.now(UTC)
    return ReplicaInfo(
        replica_id=replica.replica_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=datetime.fromtimestamp(replica.started_at, UTC),
        last_seen=now,
        state=snap.state.value,
        stats=snap.stats,
        residency=dict(snap.residency),
        metrics_at=None,
    )


def replicas(session: Session, *, replica: ThisReplica) -> list[ReplicaInfo]:
    if not replica.is_fleet:
        return [_local_replica(replica)]
    return fleet.list_replicas(session, lost_after_s=LOST_AFTER_S)


def adapters_on(
    replica: ReplicaInfo, versions: list[AdapterVersionInfo], tenant_names: dict[str, str]
) -> list[dict[str, Any]]:
    """The ready versions this replica holds, best tier first, as the console lists them."""
    residency = replica.residency
    by_ref = {v.ref_id: v for v in versions}
    tier_of: dict[str, str] = {}
    for tier in ("cpu", "gpu"):  # gpu wins: an adapter in a slot is also in host memory
        tier_of.update({ref_id: tier for ref_id in residency.get(tier, []) if ref_id in by_ref})
    on_disk = set(residency.get("disk", []))
    for v in versions:
        if v.ref_id not in tier_of and f"{v.sha256}-{v.config_sha256}" in on_disk:
            tier_of[v.ref_id] = "disk"
    pinned = set(residency.get("pinned", []))
    rows = [
        {
            "tenant_id": by_ref[ref_id].tenant_id,
            "tenant_name": tenant_names.get(by_ref[ref_id].tenant_id),
            "id": f"{by_ref[ref_id].name}@{by_ref[ref_id].version}",
            "residency": tier,
            "pinned": ref_id in pinned,
        }
        for ref_id, tier in tier_of.items()
    ]
    return sorted(rows, key=lambda r: (TIER_ORDER.index(r["residency"]), r["tenant_name"] or "", r["id"]))


def fleet_view(session: Session, *, replica: ThisReplica) -> dict[str, Any]:
    """`GET /admin/api/fleet`: every replica with state, last_seen and residency."""
    rows = replicas(session, replica=replica)
    versions = list_adapters(session, tenant_id=None)
    names = {t.id: t.name for t in list_tenants(session, include_deleted=True)}
    data = [
        {
            "object": "fleet.replica",
            "id": r.replica_id,
            "host": r.host,
            "pid": r.pid,
            "state": r.state,
            "started_at": _ts(r.started_at),
            "last_seen": _ts(r.last_seen),
            "stats": r.stats,
            "residency": r.residency,
            "adapters": adapters_on(r, versions, names),
        }
        for r in rows
    ]
    return {
        "object": "list",
        "data": data,
        "is_fleet": replica.is_fleet,
        "replica": replica.replica_id,  # the one that answered
        "lost_after_s": LOST_AFTER_S,
    }


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_expositions(texts: Iterable[str]) -> bytes:
    """Several Prometheus text expositions (disjoint label sets) -> one, each family once."""
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    return generate_latest(_Families(merged.values()))


def fleet_metrics(session: Session, *, metrics: Metrics | None, is_fleet: bool) -> bytes:
    """`GET /admin/api/fleet/metrics`: every live replica's latest snapshot, merged (see above)."""
    if metrics is None:
        return b""
    if not is_fleet:
        return metrics.render(include_tenants=True)[0]
    snapshots = fleet.replica_metrics(session, lost_after_s=LOST_AFTER_S)
    up = CollectorRegistry()
    gauge = Gauge(
        "loraserve_fleet_replica_up", "1 = heard from within the lost bound.", ["replica"], registry=up
    )
    for r in fleet.list_replicas(session, lost_after_s=LOST_AFTER_S):
        gauge.labels(r.replica_id).set(0 if r.state == "lost" else 1)
    return merge_expositions([*(text for _, text in snapshots), generate_latest(up).decode()])
