"""Priority classes: levels served strictly, fairness (VTC, fair shares) only within a level.

A request's `priority` is an integer, lower = more urgent (vLLM's and the Gateway API Inference
Extension's convention). The scheduler (scheduler.py) asks this policy three things each step:
- the order of waiting requests: most urgent level first, the admission policy's order (VTC) kept
  within a level (a stable sort);
- each tenant's share of the batch: levels are filled most urgent first, tenants sharing a level
  split what is left max-min fairly (fair_share.py), as all tenants did before there were levels;
- whom to preempt when KV blocks run short: the least urgent level first; a waiting request may
  preempt running ones of a strictly less urgent level.

Aging bounds starvation: a request gains one level per `aging_s` seconds since it arrived, but never
beyond the most urgent level present, so with one level in use (every request at the default) the
order is exactly the admission policy's. A request `k` levels below the top competes as a peer of
the top level after `k * aging_s` seconds. `aging_s <= 0` turns aging off (strict starvation).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from base_engine.fair_share import Tenant, fair_shares
from base_engine.sequence import Sequence

DEFAULT_AGING_S = 30.0

Levels = dict[Sequence, int] | None  # each request's effective level this step; None: one priority in use


@dataclass(slots=True)
class PriorityPolicy:
    aging_s: float = DEFAULT_AGING_S
    clock: Callable[[], float] = field(default=time.monotonic)

    def levels(self, seqs: Iterable[Sequence]) -> Levels:
        """Each request's effective level (its priority after aging), or None when all requests share
        one priority: then nothing here changes the scheduler's behaviour."""
        seqs = list(seqs)
        top = min((s.priority for s in seqs), default=0)
        if all(s.priority == top for s in seqs):
            return None
        now = self.clock()
        out = {}
        for s in seqs:
            gained = int((now - s.times.arrival) // self.aging_s) if self.aging_s > 0 else 0
            out[s] = max(top, s.priority - max(0, gained))
        return out

    def order(self, ordered: list[Sequence], levels: Levels) -> list[Sequence]:
        """`ordered` (the admission policy's order) with the most urgent level first, stable."""
        return ordered if levels is None else sorted(ordered, key=lambda s: levels[s])

    def shares(
        self,
        running: list[Sequence],
        ready: list[Sequence],
        max_num_seqs: int,
        levels: Levels,
    ) -> dict[Tenant, int] | None:
        """Each tenant's share of the batch: one level's tenants split what more urgent levels left
        (fair_share.fair_shares within a level); None when nobody needs a cap."""
        run, rdy = Counter(s.tenant_id for s in running), Counter(s.tenant_id for s in ready)
        if levels is None:
            return fair_shares(run, rdy, max_num_seqs)
        if len(running) + len(ready) <= max_num_seqs:
            return None
        shares: Counter[Tenant] = Counter()
        left = max_num_seqs
        for level in sorted({levels[s] for s in [*running, *ready]}):
            run_l = Counter(s.tenant_id for s in running if levels[s] == level)
            rdy_l = Counter(s.tenant_id for s in ready if levels[s] == level)
            demand = run_l + rdy_l
            if sum(demand.values()) <= left:
                split = dict(demand)
            else:  # fair_shares is None for a lone tenant: it takes what is left
                split = fair_shares(run_l, rdy_l, left) or {t: left for t in demand}
            shares.update(split)
            left -= min(left, sum(split.values()))
        for tenant in run + rdy:
            shares.setdefault(tenant, 0)
        return dict(shares)

    def victims(self, candidates: list[Sequence], levels: Levels) -> list[Sequence]:
        """Of `candidates`, those of the least urgent level (all of them when levels are not in use)."""
        if levels is None or not candidates:
            return candidates
        worst = max(levels[s] for s in candidates)
        return [s for s in candidates if levels[s] == worst]

    def less_urgent(self, seq: Sequence, running: list[Sequence], levels: Levels) -> list[Sequence]:
        """Running requests of a strictly less urgent level than `seq`, least urgent level only."""
        if levels is None:
            return []
        return self.victims([s for s in running if levels[s] > levels[seq]], levels)
