"""The engine's speculation: which running requests get drafts this step, how many, and the counts.

A request is speculated when it decodes (one uncomputed token), is not deterministic (those run
without speculation: README), has no grammar (its matcher holds one state, advanced per sampled
row), and did not opt out (``SamplingParams.speculative``). Its k never lets the emitted tokens pass
``max_tokens`` or the context. With a measured cost table (``costs``, probe.py) its k is also the one
cost.py expects to pay best at this step's number of decodes, given its acceptance and the proposer's
measured seconds per draft token; none that pays: no drafts, and a cooldown (adaptive.py); where not
even all-accepted drafts could pay (a drafter dearer than what the verify saves), no probes either.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import Protocol

from base_engine.outputs import SpecDecodeCounts
from base_engine.sequence import Sequence
from base_engine.speculative.adaptive import AdaptiveK
from base_engine.speculative.cost import CostTable, choose_k
from base_engine.speculative.ngram import NgramProposer

# The drafter's cost is trusted for "never pays" after this many timed proposals (a request's first
# one includes its prefill); then one in RECHECK such request steps drafts anyway (load changes).
MIN_DRAFT_TIMINGS = 4
RECHECK = 256


class Proposer(Protocol):
    def propose(self, request_id: str, tokens: Tokens[int], k: int) -> list[int]: ...

    def release(self, request_id: str) -> None:
        """The request left the running set: drop whatever the proposer keeps for it."""


@dataclass(slots=True)
class SpecStats:
    """Cumulative counts per adapter name ("" = base model), named after vLLM's spec_decode metrics."""

    num_drafts: Counter[str] = field(default_factory=Counter)
    num_draft_tokens: Counter[str] = field(default_factory=Counter)
    num_accepted_tokens: Counter[str] = field(default_factory=Counter)
    # adapter -> [drafts whose token at position 0 was accepted, at position 1, ...]
    num_accepted_tokens_per_pos: dict[str, list[int]] = field(default_factory=dict)
    # adapter version (AdapterRef.id, "" = base) -> [draft tokens, accepted tokens]
    by_ref: dict[str, list[int]] = field(default_factory=dict)

    def snapshot(self) -> dict[str, SpecDecodeCounts]:
        """A frozen copy for `EngineStats` (read by other threads while the engine goes on counting)."""
        return {
            name: SpecDecodeCounts(
                num_drafts=self.num_drafts[name],
                num_draft_tokens=self.num_draft_tokens[name],
                num_accepted_tokens=self.num_accepted_tokens[name],
                num_accepted_tokens_per_pos=tuple(self.num_accepted_tokens_per_pos.get(name, ())),
            )
            for name in sorted(self.num_drafts)
        }

    def acceptance_by_ref(self) -> dict[str, float]:
        return {ref: accepted / drafted for ref, (drafted, accepted) in self.by_ref.items() if drafted}

    def acceptance(self, adapter: str) -> float | None:
        drafted = self.num_draft_tokens[adapter]
        return None if drafted == 0 else self.num_accepted_tokens[adapter] / drafted


def parse_speculative(spec: str | None) -> str | None:
    """None, "ngram", "draft:<dir>"; anything else is refused by name."""
    if spec in (None, "", "off"):
        return None
    if spec == "ngram" or (spec.startswith("draft:") and len(spec) > len("draft:")):
        return spec
    raise ValueError(f"speculative must be 'ngram' or 'draft:<model dir>' (or unset), got {spec!r}")


class Speculator:
    def __init__(
        self, method: str, num_speculative_tokens: int, max_model_len: int, proposer: Proposer | None = None
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.method = method
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer: Proposer = proposer or NgramProposer()  # draft:<dir>: the engine passes one
        self.stats = SpecStats()
        self.off_batch: int | None = None  # no drafts in a step with this many decodes (None: never)
        self.adaptive: dict[str, AdaptiveK] = {}  # per running request id
        self.num_off_steps = 0  # steps switched off by off_batch
        self.costs: CostTable | None = None  # measured at start (None: adaptive k alone)
        self.draft_seconds = 0.0  # the proposer's seconds per draft token, exponentially averaged
        self.num_draft_timings = 0  # proposals timed into draft_seconds
        self.prior = (1.0, 1.0)  # (accepted, trials) over all verifies: a new request's starting alpha
        self.num_never_pays = 0  # request steps where drafts could not pay even if all accepted

    def propose(self, running: Iterable[Sequence]) -> None:
        """Sets ``draft_token_ids`` of every running request (empty where it is not speculated)."""
        running = list(running)
        live = {seq.request_id for seq in running}
        for rid in [rid for rid in self.adaptive if rid not in live]:
            del self.adaptive[rid]
            self.proposer.release(rid)
        num_decodes = sum(1 for seq in running if seq.num_uncomputed_tokens == 1)
        off = self.off_batch is not None and num_decodes >= self.off_batch
        self.num_off_steps += off
        for seq in running:
            budget = 0 if off else self._budget(seq)
            k = 0 if budget == 0 else self._k(self._state(seq), budget, num_decodes)
            seq.draft_token_ids = self._draft(seq, k) if k > 0 else []

    def _k(self, state: AdaptiveK, budget: int, num_decodes: int) -> int:
        """Adaptive k capped by the budget; with a cost table, the k that pays best (a probe: 1).
        Where not even acceptance 1 would pay (a drafter dearer than the verify saves), no drafts and
        no probes: only every RECHECK-th such request step drafts (one token), to re-time the drafter."""
        if self.costs is not None and self.num_draft_timings >= MIN_DRAFT_TIMINGS:
            never = choose_k(1.0, budget, num_decodes, self.costs, self.draft_seconds) == 0
            if never:
                self.num_never_pays += 1
                return 0 if self.num_never_pays % RECHECK else 1  # the recheck: one draft, timed
        k = min(budget, state.take())
        if k == 0 or state.probing:
            return k
        if self.costs is not None:
            k = choose_k(state.alpha, k, num_decodes, self.costs, self.draft_seconds)
            if k == 0:
                state.pause()  # accepted or not, drafts do not pay here: re-measure after a cooldown
                return 0
        state.resume()
        return k

    def _draft(self, seq: Sequence, k: int) -> list[int]:
        start = time.perf_counter()
        drafts = self.proposer.propose(seq.request_id, seq.prompt_token_ids + seq.output_token_ids, k)
        if drafts:  # the drafter's time per token, what cost.py charges each draft
            per_token = (time.perf_counter() - start) / len(drafts)
            previous = self.draft_seconds or per_token
            self.draft_seconds = 0.5 * previous + 0.5 * per_token
            self.num_draft_timings += 1
        return drafts

    def _state(self, seq: Sequence) -> AdaptiveK:
        state = self.adaptive.get(seq.request_id)
        if state is None:
            # A new request's acceptance starts at what this engine's drafts have had lately.
            accepted, trials = self.prior
            state = self.adaptive[seq.request_id] = AdaptiveK(self.k, accepted=accepted, trials=trials)
        return state

    def _budget(self, seq: Sequence) -> int:
        params = seq.params
        if (
            seq.num_uncomputed_tokens != 1
            or not seq.output_token_ids
            or seq.deterministic
            or params.constraint is not None
            or params.has_logit_rules  # min_tokens / bad words depend on the position: no drafts
            or not params.speculative
        ):
            return 0
        room_output = params.max_tokens - seq.num_output_tokens - 1
        room_context = self.max_model_len - seq.num_tokens - 1
        return max(0, min(self.k, room_output, room_context))

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self._state(seq).update(num_drafts, num_accepted)
        accepted, trials = self.prior  # averaged slower than a request's own (1 / 8 per verify)
        rejected = num_accepted < num_drafts
        trial = num_accepted + rejected
        self.prior = (0.875 * accepted + 0.125 * num_accepted, 0.875 * trials + 0.125 * trial)
        name = "" if seq.adapter is None else seq.adapter.name
        counts = self.stats.by_ref.setdefault("" if seq.adapter is None else seq.adapter.id, [0, 0])
        counts[0] += num_drafts
        counts[1] += num_accepted
        self.stats.num_drafts[name] += 1
        self.stats.num_draft_tokens[name] += num_drafts
        self.stats.num_accepted_tokens[name] += num_accepted
        per_pos = self.stats.num_accepted_tokens_per_pos.setdefault(name, [])
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(num_accepted):  # the accepted drafts are a prefix: positions 0..a-1
            per_pos[position] += 1
