"""Admission across adapters and tenants: adapter residency, bounded waiting, VTC fairness.

- A request starts only once its adapter holds a device slot (so at most `max_loras` distinct
  adapters run in any step); while its adapter loads in the background it waits and the others run.
- Tenants share the token budget by the Virtual Token Counter ("Fairness in Serving Large Language
  Models", Sheng et al., OSDI 2024): the waiting request of the tenant with the smallest counter goes
  first; a tenant returning from idle is lifted to the smallest active counter so it cannot bank credit.
- Bounded waiting: a request older than `max_wait_s` goes before everyone, and while it cannot get a
  slot no request may take a free slot for another adapter, so slots drain to it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from adapters.cache import AdapterCache
from base_engine.scheduler import AdmissionPolicy, SchedulerOutput
from base_engine.sequence import Sequence

PROMPT_WEIGHT = 1.0  # VTC cost of a computed prompt token
OUTPUT_WEIGHT = 2.0  # ... and of a generated token (decode is the costlier phase per token)


class LoraAdmissionPolicy(AdmissionPolicy):
    def __init__(self, cache: AdapterCache, *, max_wait_s: float) -> None:
        self.cache = cache
        self.max_wait_s = max_wait_s
        self.counters: dict[str | None, float] = {}
        self._overdue_blocked: Sequence | None = None
        self._active: set[str | None] = set()

    def order(self, waiting: Iterable[Sequence], running: list[Sequence]) -> list[Sequence]:
        waiting = list(waiting)
        self._lift_returning_tenants(waiting, running)
        now = time.monotonic()
        self._overdue_blocked = None

        def key(seq: Sequence) -> tuple[bool, float, float]:
            is_overdue = now - seq.times.arrival > self.max_wait_s
            return (
                not is_overdue,
                0.0 if is_overdue else self.counters.get(seq.tenant_id, 0.0),
                seq.times.arrival,
            )

        return sorted(waiting, key=key)

    def _lift_returning_tenants(self, waiting: list[Sequence], running: list[Sequence]) -> None:
        active = {s.tenant_id for s in running} | {s.tenant_id for s in waiting}
        staying = [self.counters[t] for t in active & self._active if t in self.counters]
        floor = min(staying) if staying else 0.0
        for tenant in active - self._active:  # back from idle (or new): no banked credit
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self._active = active

    def can_admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Its adapter can get a device slot now (and free slots are not kept for an overdue request)."""
        ref = seq.adapter
        if ref is None or seq.adapter_slot >= 0:
            return True
        if self._is_held_for_overdue(seq):
            return False
        return self.cache.can_acquire(ref)

    def admit(self, seq: Sequence) -> None:
        """Takes the slot `can_admit` found (given back by `on_not_admitted` if the request cannot start)."""
        ref = seq.adapter
        if ref is None or seq.adapter_slot >= 0:
            return
        slot = self.cache.acquire(ref)
        if slot is None:
            raise RuntimeError(f"adapter {ref.id} got no slot right after can_admit said it would")
        seq.adapter_slot = slot

    def on_refused(self, seq: Sequence) -> None:
        """`can_admit` said no: load a missing adapter; an overdue request that found every slot held
        keeps free slots for itself from now on, so they drain to it."""
        ref = seq.adapter
        if ref is None or self._is_held_for_overdue(seq):
            return
        self.cache.request_load(ref)  # no-op when it is in the host tier, loading or refused
        if self._overdue_blocked is None and time.monotonic() - seq.times.arrival > self.max_wait_s:
            self._overdue_blocked = seq

    def _is_held_for_overdue(self, seq: Sequence) -> bool:
        """Another request is overdue and blocked: only adapters already in a slot may start."""
        blocked = self._overdue_blocked
        assert seq.adapter is not None
        return blocked is not None and blocked is not seq and seq.adapter.id not in self.cache.slot_of

    def on_not_admitted(self, seq: Sequence) -> None:
        # The slot goes back so a request that waits holds nothing; acquiring it again is a cache hit
        # unless another adapter needed the slot meanwhile.
        if seq.adapter_slot >= 0:
            self.cache.release(seq.adapter_slot)
            seq.adapter_slot = -1

    def on_scheduled(self, output: SchedulerOutput) -> None:
        for item in output.scheduled:
            seq = item.seq
            prompt_left = max(0, seq.num_prompt_tokens - item.start)
            num_prompt = min(item.num_new_tokens, prompt_left)
            cost = PROMPT_WEIGHT * num_prompt + OUTPUT_WEIGHT * int(item.is_sampled and num_prompt == 0)
            self.counters[seq.tenant_id] = self.counters.get(seq.tenant_id, 0.0) + cost
