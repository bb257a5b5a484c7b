"""Fair shares of the running batch: how many sequences each tenant may run while others wait.

Fair admission (api/tenancy/admission.py) and the Virtual Token Counter (base_engine/lora_policy.py)
decide who is admitted and who starts first, but a tenant whose sequences already fill the batch
(`max_num_seqs`) would keep it until they end: with 64 long streams of one tenant running, another
tenant's requests waited a minute for their first token. So at every step boundary the scheduler asks
for each tenant's share of the batch, max-min fairly over what each one wants now (running plus ready
waiting sequences, every sequence of an `n` > 1 request counted). A tenant running more than its share
yields its newest sequences (preemption by recompute: their tokens are kept and recomputed, and the
answer is the same) and starts no more while it is over; the freed slots go to the tenants below
their share. When everyone fits, nobody is capped: a lone tenant uses the whole batch.

    max_num_seqs 8, wants {X: 10 (8 running), Y: 3 (0 running)}  ->  shares {X: 5, Y: 3}: X yields 3

Nobody starves: every tenant that wants a slot gets at least `max_num_seqs // contenders` of them (one
more for some when it does not divide), and a yielded sequence goes back ahead of its tenant's never
started ones, recomputing mostly from the prefix cache (its full blocks stay cached).
"""

from __future__ import annotations

from collections import Counter

from base_engine.sequence import Sequence

Tenant = str | None  # a sequence's tenant id (None for requests that name none)


def fair_shares(
    running: Counter[Tenant], ready: Counter[Tenant], max_num_seqs: int
) -> dict[Tenant, int] | None:
    """Each tenant's share of the batch (water-filling over `running + ready` per tenant), or None
    when every tenant's demand fits and nobody needs a cap.

    The slots a level leaves over (`max_num_seqs` not divisible) go to the tenants running the most
    now, so that an even split preempts as little as possible:

        running {X: 8}, ready {X: 2, Y: 3}, 8 slots  ->  {X: 5, Y: 3}
        running {X: 4, Y: 4}, ready {Z: 9}, 8 slots  ->  {X: 3, Y: 3, Z: 2}
    """
    demand = running + ready
    if sum(demand.values()) <= max_num_seqs or len(demand) < 2:
        return None
    shares: dict[Tenant, int] = {}
    left = max_num_seqs
    pending = sorted(demand, key=lambda t: demand[t])  # smallest demand first: it is met in full
    while pending:
        level = left // len(pending)
        if demand[pending[0]] > level:
            break
        tenant = pending.pop(0)
        shares[tenant] = demand[tenant]
        left -= demand[tenant]
    if pending:
        level, extra = divmod(left, len(pending))
        by_running = sorted(pending, key=lambda t: (-running[t], str(t)))
        for i, tenant in enumerate(by_running):
            shares[tenant] = level + (1 if i < extra else 0)
    return shares


def over_share(running: list[Sequence], shares: dict[Tenant, int]) -> list[Sequence]:
    """The sequences to yield: each tenant's newest running ones beyond its share (`running` is
    oldest first, as the scheduler serves it)."""
    held = Counter(seq.tenant_id for seq in running)
    victims = []
    for seq in reversed(running):  # newest first
        if held[seq.tenant_id] > shares.get(seq.tenant_id, 0):
            held[seq.tenant_id] -= 1
            victims.append(seq)
    return victims
