"""Fleet membership: replica heartbeats with their residency, operator pins, fleet events.

Three tables, one idea each:
- `fleet_replicas`: one row per live replica, rewritten by its heartbeat (state, engine summary,
  which adapters it holds, its latest metrics exposition). "lost" is not stored: a reader derives it
  from `last_seen`, so a replica killed with kill -9 needs nobody to mark it.
- `fleet_pins`: operator pins as state. A replica that starts later applies every pin in force
  (the adapter still ready, its tenant active) without replaying history.
- `fleet_events`: an append-only log of admin actions that touch residency (pin, unpin, adapter
  delete, tenant suspend/activate/delete), written in the same transaction as the change itself.
  Events are the wake-up; the tables above are the truth.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, CheckConstraint, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from registry.models import Base, utcnow


class ReplicaState(enum.StrEnum):
    """What a replica says about itself; "lost" is derived by readers from a stale `last_seen`."""

    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class FleetEventKind(enum.StrEnum):
    PIN = "pin"
    UNPIN = "unpin"
    ADAPTER_DELETE = "adapter_delete"
    TENANT_SUSPEND = "tenant_suspend"
    TENANT_ACTIVATE = "tenant_activate"
    TENANT_DELETE = "tenant_delete"


def _in(column: str, enum_cls: type[enum.StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(m.value) for m in enum_cls)})"


class FleetReplica(Base):
    __tablename__ = "fleet_replicas"
    __table_args__ = (CheckConstraint(_in("state", ReplicaState), name="state"),)

    replica_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    state: Mapped[str] = mapped_column(String(16), default=ReplicaState.STARTING.value)
    # Engine summary: num_running, num_waiting, kv_cache_usage, num_in_flight, adapter slots.
    stats: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # {"gpu": [ref ids], "cpu": [ref ids], "pinned": [ref ids], "disk": ["<sha256>-<config sha256>"]}
    residency: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # The replica's latest /metrics exposition (replica label on every series), for
    # GET /admin/api/fleet/metrics where one HTTP entry point fronts every replica (Ray Serve).
    metrics: Mapped[str | None] = mapped_column(Text)
    metrics_at: Mapped[datetime | None] = mapped_column()


class FleetPin(Base):
    """An operator pin of one adapter version, in force on every replica while the row exists."""

    __tablename__ = "fleet_pins"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    pinned_at: Mapped[datetime] = mapped_column(default=utcnow)


class FleetEvent(Base):
    """One admin action every replica applies; `id` only grows (replicas poll `id > last seen`)."""

    __tablename__ = "fleet_events"
    __table_args__ = (CheckConstraint(_in("kind", FleetEventKind), name="kind"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    tenant_id: Mapped[str | None] = mapped_column(String(32))
    # e.g. {"ref_ids": ["<tenant>/<name>@<v>", ...]} for pin/unpin/adapter_delete
    payload: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
