"""How an admin action on this replica reaches the fleet's other replicas.

In a fleet, an action that touches residency (pin, unpin, adapter delete, tenant status) goes
through `registry.fleet`, which writes the change and its fleet event in one transaction; every
replica's agent (api/fleet/agent.py) applies it within a beat, and this replica's at once: `wake()`
sets the event its agent waits on between beats. Outside a fleet nothing waits on it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FleetSync:
    is_fleet: bool
    wakeup: threading.Event = field(default_factory=threading.Event)  # the agent's between-beats wait

    def wake(self) -> None:
        """Poll now: the agent applies this replica's own action without waiting for its next beat."""
        self.wakeup.set()
