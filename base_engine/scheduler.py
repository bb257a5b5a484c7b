"""Token-budget continuous batching (Orca, OSDI 2022; vLLM v1's unified scheduler).

Each step gives every scheduled request a number of tokens: a decode is 1, a prefill chunk is up to the
remaining budget; prefix hits simply start a request with tokens already computed. Running requests
are served first (oldest first), then waiting ones are admitted in the order the admission policy
gives. When blocks run out the newest running request of the tenant running the most is preempted and
recomputed later. While tenants contend for the batch, each runs at most its fair share of it
(base_engine/fair_share.py): one over its share yields its newest sequences at the step boundary.
Priority classes (base_engine/priority.py) order all of this by level first: with one level in use
nothing changes; with several, levels are served strictly and fairness holds within a level.

LongRoPE (Phi-3, `long_factor_after` = original_max_position_embeddings = O): transformers' generate
rotates with the short factors while a forward's max position + 1 <= O and with the long ones
beyond, and when a sequence first outgrows O it drops its cache and recomputes the whole sequence
(Phi3ForCausalLM.prepare_inputs_for_generation). So each logit a sequence of n tokens gets is that of
one forward over all n tokens with the long factors iff n > O. Per sequence here: a request with more
than O tokens at admission runs long from its first chunk (every chunk of a long prompt, a recompute
after preemption); a running one whose decode takes it from O to O + 1 tokens drops its short-factor
blocks and recomputes all O + 1 tokens long (its prefix-cache keys carry the factor set).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from base_engine.block_manager import BlockManager
from base_engine.fair_share import Tenant, over_share
from base_engine.priority import Levels, PriorityPolicy
from base_engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of this request computed in this step
    start: int  # its num_computed_tokens before the step (position of the first new token)
    drafts: list[int] = field(default_factory=list)  # speculative tokens scored after its last one

    @property
    def is_sampled(self) -> bool:
        """The step reaches the end of the request's tokens, so it yields a new token."""
        return self.start + self.num_new_tokens == self.seq.num_tokens + len(self.drafts)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # batch order = flattened token order
    num_batched_tokens: int = 0  # sum of num_new_tokens
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting: out of KV blocks
    yielded: list[Sequence] = field(default_factory=list)  # sent back to waiting: over its tenant's share
    overflowed: list[Sequence] = field(default_factory=list)  # can never fit the whole KV pool: to finish

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class AdmissionPolicy:
    """Order of waiting requests and whether one may start now. The default is FCFS, all admissible.

    The multi-LoRA policy (adapter residency, max distinct adapters per step, tenant fairness)
    replaces it; it is also told when requests start and which tokens were scheduled.
    """

    def order(self, waiting: Iterable[Sequence], running: list[Sequence]) -> list[Sequence]:
        """The order in which waiting requests are considered (`running`: who runs now)."""
        return list(waiting)

    def can_admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether `seq` may start now (a question: takes nothing)."""
        return True

    def admit(self, seq: Sequence) -> None:
        """`can_admit` said yes: take what the request needs to start (e.g. its adapter's slot)."""
        return None

    def on_refused(self, seq: Sequence) -> None:
        """`can_admit` said no: prepare for a later try (e.g. start loading what is missing)."""
        return None

    def on_scheduled(self, output: SchedulerOutput) -> None:
        return None

    def on_not_admitted(self, seq: Sequence) -> None:
        """`admit` ran but the request could not start: give back what it took."""
        return None


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: AdmissionPolicy | None = None,
        long_factor_after: int | None = None,
        priority: PriorityPolicy | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy or AdmissionPolicy()
        self.long_factor_after = long_factor_after  # LongRoPE's original context (module docstring)
        self.priority = priority or PriorityPolicy()  # levels across, fairness within (priority.py)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        levels = self.priority.levels([*self.running, *self.waiting])  # None: one priority in use
        if levels is not None:
            self.running.sort(key=levels.__getitem__)  # most urgent level first, oldest first within
        # 0. Tenants over their share of the batch while others wait yield their newest sequences.
        shares = self._shares(levels)
        if shares is not None:
            for seq in over_share(self.running, shares):
                self._preempt(seq)
                self.policy.on_not_admitted(seq)  # its adapter slot too: a waiting request holds nothing
                out.yielded.append(seq)
        # 1. Running requests, oldest first: decodes and the rest of chunked prefills.
        i, urgent_pass = 0, levels is not None  # at most one early pass for more urgent waiting work
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if urgent_pass and not out.preempted and self._more_urgent_waits(seq, levels):
                urgent_pass = False
                i, budget = self._admit_more_urgent(i, budget, out, shares, levels)
                if i >= len(self.running) or budget <= 0:
                    break
                seq = self.running[i]
            if not seq.is_long_rope and self._needs_long_rope(seq):
                self._restart_long_rope(seq)
            drafts = seq.draft_token_ids[: max(0, budget - seq.num_uncomputed_tokens)]
            num_new = min(seq.num_uncomputed_tokens + len(drafts), budget)
            if self._exceeds_pool(seq, num_new):
                out.overflowed.append(seq)
                i += 1
                continue
            if not self._make_room(seq, num_new, i, out, levels):
                continue  # seq itself was preempted: the one after it is now at i
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens, drafts))
            budget -= num_new
            i += 1
        # 2. Waiting requests, unless this step had to preempt (memory is tight: let running ones finish).
        if not out.preempted:
            budget = self._admit_waiting(budget, out, shares, levels)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        self.policy.on_scheduled(out)
        return out

    def _exceeds_pool(self, seq: Sequence, num_new: int) -> bool:
        needed = -(-(seq.num_computed_tokens + num_new) // self.block_manager.block_size)
        return needed > self.block_manager.num_blocks

    def _shares(self, levels: Levels) -> dict[Tenant, int] | None:
        """Each tenant's share of the batch this step, or None when every tenant fits (a question)."""
        if len(self.running) + len(self.waiting) <= self.max_num_seqs:
            return None  # the common case, decided without a pass over the requests
        tenants = {seq.tenant_id for seq in self.running} | {seq.tenant_id for seq in self.waiting}
        if len(tenants) < 2:
            return None
        ready = [s for s in self.waiting if self.policy.can_admit(s, self.running)]
        return self.priority.shares(self.running, ready, self.max_num_seqs, levels)

    def _make_room(
        self,
        seq: Sequence,
        num_new: int,
        start: int,
        out: SchedulerOutput,
        levels: Levels,
    ) -> bool:
        """Allocate blocks for seq (at `start` in running), preempting requests not yet scheduled in this
        step if needed: of the least urgent level, the newest of the tenant that runs the most there
        (a lone tenant: the newest)."""
        while not self.block_manager.can_allocate(seq, num_new):
            candidates = self.priority.victims(self.running[start:], levels)
            held = Counter(s.tenant_id for s in candidates)
            most = max(held[s.tenant_id] for s in candidates)
            victim = next(s for s in reversed(candidates) if held[s.tenant_id] == most)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_new)
        return True

    def _more_urgent_waits(self, seq: Sequence, levels: Levels) -> bool:
        return levels is not None and any(levels[w] < levels[seq] for w in self.waiting)

    def _admit_more_urgent(
        self,
        i: int,
        budget: int,
        out: SchedulerOutput,
        shares: dict[Tenant, int] | None,
        levels: Levels,
    ) -> tuple[int, int]:
        """Running request i is of a less urgent level than a waiting one: admit the waiting requests of
        levels more urgent than it before it and the rest of its level take the step's budget (levels
        are served strictly: an urgent prefill does not wait behind a less urgent chunk or decode).
        They go into `running` at i, kept sorted by level; returns (index of request i now, budget)."""
        assert levels is not None
        before = set(map(id, self.running))
        budget = self._admit_waiting(budget, out, shares, levels, below=levels[self.running[i]])
        # Preemptions for the admitted ones take victims from running[i:] only (less urgent levels).
        admitted = [s for s in self.running if id(s) not in before]
        rest = [s for s in self.running if id(s) in before]
        self.running[:] = rest[:i] + admitted + rest[i:]
        return i + len(admitted), budget

    def _admit_waiting(
        self,
        budget: int,
        out: SchedulerOutput,
        shares: dict[Tenant, int] | None,
        levels: Levels,
        below: int | None = None,
    ) -> int:
        """Admit waiting requests in priority then policy order (only levels under `below` if given)."""
        num_running = Counter(seq.tenant_id for seq in self.running) if shares is not None else Counter()
        for seq in self.priority.order(self.policy.order(self.waiting, self.running), levels):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if below is not None and levels is not None and levels[seq] >= below:
                break  # the order is most urgent level first: no more urgent one behind
            if shares is not None and num_running[seq.tenant_id] >= shares.get(seq.tenant_id, 0):
                continue  # its tenant holds its share while others wait
            if not self.policy.can_admit(seq, self.running):
                self.policy.on_refused(seq)
                continue
            self.policy.admit(seq)
            # A waiting request holds no blocks (preemption and rollback free them), so its prefix
            # hits are attached here and either kept by the allocation below or given back at once:
            # two waiting requests can never sit on blocks the other one needs.
            seq.is_long_rope = self._needs_long_rope(seq)  # before the prefix lookup: part of its key
            num_hit = self.block_manager.match_prefix(seq)
            seq.num_computed_tokens = num_hit
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._exceeds_pool(seq, num_new):
                self._roll_back(seq)
                out.overflowed.append(seq)
                continue
            is_partial = num_new < seq.num_uncomputed_tokens
            if not (is_partial and not self.enable_chunked_prefill):
                budget += self._preempt_less_urgent(seq, num_new, out, levels)
            if (is_partial and not self.enable_chunked_prefill) or not self.block_manager.can_allocate(
                seq, num_new
            ):
                self._roll_back(seq)
                break  # FCFS: a request that cannot start blocks the ones behind it
            self.block_manager.allocate(seq, num_new)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = time.monotonic()
            self.running.append(seq)
            num_running[seq.tenant_id] += 1
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
            budget -= num_new
        return budget

    def _preempt_less_urgent(self, seq: Sequence, num_new: int, out: SchedulerOutput, levels: Levels) -> int:
        """KV blocks are short for waiting `seq`: preempt running requests of strictly less urgent
        levels (least urgent, newest first) until it fits or none is left; the token budget freed."""
        freed = 0
        while not self.block_manager.can_allocate(seq, num_new):
            victims = self.priority.less_urgent(seq, self.running, levels)
            if not victims:
                break
            victim = victims[-1]
            for item in [x for x in out.scheduled if x.seq is victim]:
                out.scheduled.remove(item)
                freed += item.num_new_tokens
            self._preempt(victim)
            self.policy.on_not_admitted(victim)
            out.preempted.append(victim)
        return freed

    def _needs_long_rope(self, seq: Sequence) -> bool:
        return self.long_factor_after is not None and seq.num_tokens > self.long_factor_after

    def _restart_long_rope(self, seq: Sequence) -> None:
        """The sequence outgrew LongRoPE's original context: its K/V (short factors) are recomputed
        with the long factors, from blocks another long sequence left in the prefix cache if any."""
        self.block_manager.free_sequence(seq)
        seq.is_long_rope = True
        seq.num_computed_tokens = self.block_manager.match_prefix(seq)

    def _roll_back(self, seq: Sequence) -> None:
        """Undo an admission attempt: prefix blocks and the adapter slot go back, nothing is held."""
        self.block_manager.unmatch_prefix(seq)
        seq.num_computed_tokens = 0
        self.policy.on_not_admitted(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV blocks, keep its tokens, queue it first."""
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The only place a request leaves the scheduler (finished, aborted or failed)."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)
