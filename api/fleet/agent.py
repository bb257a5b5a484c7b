"""The replica agent: makes one process a member of a fleet that shares one database.

A background thread (never the engine thread, never the event loop), every `heartbeat_s`:
1. heartbeat: this replica's row in `fleet_replicas` (state, engine summary, residency; every
   `metrics_every` beats its /metrics exposition too);
2. events: `fleet_events` after the last id seen, applied here: pin/unpin and tenant activation
   reconcile this engine's pins with `fleet_pins`; an adapter delete or a tenant suspend/delete
   evicts those adapters from this replica's adapter cache (pin, host copy, idle slot);
3. every `reconcile_every` beats, and at start: pins in force pinned here, resident adapters that may
   no longer be served evicted. This is what a replica started later, or one that missed an event
   (a DB outage, an event committed out of id order), converges by: events are the wake-up, the
   tables the truth.

Its own database engine has a short bound (`DB_TIMEOUT_S`: connection, and each call); an outage
only makes beats fail (logged once per outage) and the replica look "lost" to others; serving goes
on. Engine changes run on the engine thread through the `AsyncEngine` facade, awaited from this
thread with a deadline. A clean shutdown (`stop()`) removes the row. Prefix-cache blocks of an
evicted adapter are not dropped: their keys carry the adapter's id and hash, so no request can reach
them, and they are reused as free blocks (LRU).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.fleet.snapshot import ThisReplica
from api.metrics.prometheus import Metrics
from registry import fleet
from registry.db import make_engine, session_factory
from registry.fleet_models import FleetEventKind

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEAT_S = 1.0
LOST_AFTER_S = 10.0  # readers show a replica silent for longer as "lost" (10 missed beats)
METRICS_EVERY = 3  # beats between metrics snapshots
RECONCILE_EVERY = 5  # beats between full reconciliations with the tables
PRUNE_EVERY = 600  # beats between prunes of old events and long-lost replica rows
EVENTS_KEPT_S = 24 * 3600.0
LOST_ROWS_KEPT_S = 3600.0
DB_TIMEOUT_S = 5.0
ENGINE_CALL_TIMEOUT_S = 10.0
_TENANT_GONE = (FleetEventKind.TENANT_SUSPEND, FleetEventKind.TENANT_DELETE)


class ReplicaAgent:
    """`replica`: what this process reports and whose engine applies the fleet's changes; `metrics`:
    the /metrics exposition stored with every `METRICS_EVERY`th beat (None: none); `wakeup`: set by
    admin actions on this replica (api/fleet/sync.py); `db`: an engine of its own behind
    `sessions`, disposed by `stop()`."""

    def __init__(
        self,
        replica: ThisReplica,
        *,
        metrics: Metrics | None,
        loop: asyncio.AbstractEventLoop,
        sessions: sessionmaker[Session],
        heartbeat_s: float = HEARTBEAT_S,
        wakeup: threading.Event | None = None,
        db: Engine | None = None,
    ) -> None:
        self.replica = replica
        self.metrics = metrics
        self.loop = loop
        self.replica_id = replica.replica_id
        self.sessions = sessions
        self.heartbeat_s = heartbeat_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.cursor: int | None = None  # last event id applied; None = not caught up yet
        self.num_beats = 0
        self._is_failing = False
        self._stop = threading.Event()
        self._wake = wakeup if wakeup is not None else threading.Event()
        self._db = db
        self._thread = threading.Thread(target=self._run, name="loraserve-fleet-agent", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Poll now: an admin action on this replica applies here without waiting for the next beat."""
        self._wake.set()

    async def stop(self) -> None:
        """At shutdown: stop the thread, leave the fleet, then close its own database engine (off the
        event loop: each may wait)."""
        await asyncio.to_thread(self._stop_and_leave)
        if self._db is not None:
            self._db.dispose()

    def _stop_and_leave(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2 * DB_TIMEOUT_S + ENGINE_CALL_TIMEOUT_S)
        try:
            with self.sessions() as session:
                fleet.remove_replica(session, replica_id=self.replica_id)
        except Exception:  # noqa: BLE001 - the row then shows "lost" and is pruned later
            logger.warning("replica %s could not remove its fleet row", self.replica_id, exc_info=True)

    # ---- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()

    def tick(self) -> None:
        """One beat: heartbeat, events (or catching up first), periodic reconcile and prune."""
        try:
            with self.sessions() as session:
                self._beat(session)
                if self.cursor is None or self.num_beats % RECONCILE_EVERY == 0:
                    self._catch_up(session)
                else:
                    self._poll(session)
                if self.num_beats % PRUNE_EVERY == PRUNE_EVERY - 1:
                    fleet.prune_events(session, older_than_s=EVENTS_KEPT_S)
                    fleet.prune_replicas(session, silent_for_s=LOST_ROWS_KEPT_S)
        except Exception as exc:  # noqa: BLE001 - a database outage must never stop serving
            if not self._is_failing:
                logger.warning(
                    "fleet agent of %s: %s: %s (retrying)", self.replica_id, type(exc).__name__, exc
                )
            self._is_failing = True
            return
        if self._is_failing:
            logger.warning("fleet agent of %s: database reachable again", self.replica_id)
        self._is_failing = False

    def _beat(self, session: Session) -> None:
        snap = self.replica.snapshot()
        metrics = None
        if self.metrics is not None and self.num_beats % METRICS_EVERY == 0:
            metrics = self.metrics.render(include_tenants=True)[0].decode()
        fleet.heartbeat(
            session,
            replica_id=self.replica_id,
            host=self.host,
            pid=self.pid,
            state=snap.state,
            stats=snap.stats,
            residency=snap.residency,
            metrics=metrics,
        )
        self.num_beats += 1

    def _catch_up(self, session: Session) -> None:
        """Converge on the tables: the cursor first, so no event committed meanwhile is skipped."""
        latest = fleet.latest_event_id(session)
        self._reconcile(session)
        if self.cursor is None or latest > self.cursor:
            self.cursor = latest

    def _poll(self, session: Session) -> None:
        assert self.cursor is not None
        events = fleet.events_after(session, after_id=self.cursor)
        if not events:
            return
        evict = [ref_id for e in events if e.kind == FleetEventKind.ADAPTER_DELETE for ref_id in e.ref_ids]
        gone_tenants = {e.tenant_id for e in events if e.kind in _TENANT_GONE and e.tenant_id}
        resident = self._resident_ids()
        evict += [r for r in resident if r.partition("/")[0] in gone_tenants]
        if evict:
            self._evict(evict)
        self._reconcile_pins(session)
        self.cursor = events[-1].id
        logger.info("replica %s applied fleet events up to %d", self.replica_id, self.cursor)

    # ---- reconciling with the tables ------------------------------------------------------------

    def _reconcile(self, session: Session) -> None:
        stale = fleet.stale_refs(session, ref_ids=sorted(self._resident_ids()))
        if stale:
            self._evict(sorted(stale))
        self._reconcile_pins(session)

    def _reconcile_pins(self, session: Session) -> None:
        wanted = {info.ref_id: info.ref for info in fleet.pins_in_force(session)}
        self._on_engine(self.replica.engine.set_adapter_pins(wanted))

    def _resident_ids(self) -> set[str]:
        pinned = self.replica.engine.stats().adapters.pinned
        return set(self.replica.engine.adapter_residency()) | set(pinned)

    def _evict(self, ref_ids: list[str]) -> None:
        for ref_id in self._on_engine(self.replica.engine.evict_adapters(ref_ids)):
            logger.info("adapter %s still serves in-flight requests: its slot is freed after them", ref_id)

    def _on_engine(self, call: Coroutine[Any, Any, T]) -> T:
        """Run an engine facade call on the app's loop (the engine thread does the work between
        steps); wait at most ENGINE_CALL_TIMEOUT_S."""
        future = asyncio.run_coroutine_threadsafe(call, self.loop)
        return future.result(timeout=ENGINE_CALL_TIMEOUT_S)


def start_agent(
    replica: ThisReplica, *, metrics: Metrics | None, db_url: str, wakeup: threading.Event
) -> ReplicaAgent:
    """Join the fleet (from the app's lifespan, on its event loop) with a database engine of the
    agent's own; the caller stops it with `agent.stop()` at shutdown. Also labels this replica's
    /metrics with `replica`."""
    db = make_engine(db_url, timeout_s=DB_TIMEOUT_S)
    agent = ReplicaAgent(
        replica,
        metrics=metrics,
        loop=asyncio.get_running_loop(),
        sessions=session_factory(db),
        wakeup=wakeup,
        db=db,
    )
    if metrics is not None:
        metrics.replica = agent.replica_id
    agent.start()
    logger.info("replica %s joined the fleet", agent.replica_id)
    return agent
