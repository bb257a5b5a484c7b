"""What one replica says about itself: its id, state, engine summary and adapter residency.

The agent (api/fleet/agent.py) writes this into `fleet_replicas` every heartbeat; in single-process
mode `GET /admin/api/fleet` shows the same snapshot of the one process, built live, so the console's
fleet view reads one shape either way. Reads only in-memory state (the engine's last stats, the
disk tier's index): cheap, never blocks on I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.settings import Settings
from api.state import AppState
from registry.fleet_models import ReplicaState


def replica_id_of(settings: Settings) -> str:
    """`settings.replica_id`, or "<hostname>-<pid>": unique per process on a host, readable in the console."""
    return settings.replica_name


@dataclass(frozen=True, slots=True)
class Snapshot:
    state: ReplicaState
    stats: dict[str, Any]  # engine summary (JSON-ready)
    residency: dict[str, list[str]]  # {"gpu": [ref ids], "cpu": [...], "pinned": [...], "disk": [keys]}


def replica_state(state: AppState) -> ReplicaState:
    if state.admission.is_draining:
        return ReplicaState.DRAINING
    if not state.engine_is_running:
        return ReplicaState.STARTING
    return ReplicaState.READY if state.engine.is_healthy else ReplicaState.UNHEALTHY


def take_snapshot(state: AppState) -> Snapshot:
    stats = state.engine.stats()
    adapters = stats.adapters
    residency = state.engine.adapter_residency()
    summary = {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_cache_usage": round(float(stats.kv_cache_usage), 4),
        "num_in_flight": state.admission.num_in_flight,
        "num_adapter_slots": adapters.num_slots,
        "num_adapter_loads": adapters.loads,
    }
    return Snapshot(
        state=replica_state(state),
        stats=summary,
        residency={
            "gpu": sorted(r for r, tier in residency.items() if tier == "gpu"),
            "cpu": sorted(r for r, tier in residency.items() if tier == "cpu"),
            "pinned": sorted(adapters.pinned),
            "disk": sorted(state.disk.entries()),
        },
    )
