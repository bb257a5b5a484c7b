"""Adaptive k: each request's number of drafts follows its own recent acceptance.

State per request (`AdaptiveK`), updated only from verified counts, so it is a function of the
request's tokens and its drafts (no clock): an exponential average of the acceptance rate (halved
weight per verify) sets k = floor(avg * (K + 1)), clamped to [0, K]. A request whose average falls to
k = 0 proposes nothing for `cooldown` steps, then probes with k = 1; a failed probe doubles the cooldown
(MIN_COOLDOWN .. MAX_COOLDOWN), an accepted one resets it and k grows back as the average recovers.

`alpha` is the per-token acceptance the cost policy (cost.py) weighs against the verify's measured
cost: accepted drafts over trials (accepted + 1 per verify that rejected one), both exponentially
averaged the same way. When the policy finds no k that pays, `pause` starts a cooldown as k = 0 does
(doubling each time, reset only once drafts pay again), so a request whose drafts are accepted but
too dear re-measures rarely.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_COOLDOWN = 8
MAX_COOLDOWN = 64


@dataclass(slots=True)
class AdaptiveK:
    max_k: int
    average: float = 1.0  # acceptance rate, exponentially averaged over this request's verifies
    cooldown: int = 0  # steps left without drafts
    next_cooldown: int = MIN_COOLDOWN
    probing: bool = False
    accepted: float = 1.0  # accepted drafts per verify, averaged as `average` (optimistic start)
    trials: float = 1.0  # accepted drafts + 1 per verify that rejected one, averaged the same way

    @property
    def alpha(self) -> float:
        """Per-token acceptance: the chance a draft is accepted when the ones before it were."""
        return self.accepted / self.trials if self.trials > 0 else 0.0

    @property
    def k(self) -> int:
        return max(0, min(self.max_k, int(self.average * (self.max_k + 1))))

    def take(self) -> int:
        """This step's k (0 while cooling down; 1 for the probe that ends a cooldown)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            if self.cooldown == 0:
                self.probing = True
            return 0
        return 1 if self.probing else self.k

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """After a verify of `num_drafts` drafts (>= 1), `num_accepted` of them kept."""
        self.average = 0.5 * self.average + 0.5 * (num_accepted / num_drafts)
        self.accepted = 0.5 * self.accepted + 0.5 * num_accepted
        self.trials = 0.5 * self.trials + 0.5 * (num_accepted + (num_accepted < num_drafts))
        if self.probing:
            self.probing = False
            if num_accepted == num_drafts:
                self.average = max(self.average, 1.0 / (self.max_k + 1))  # at least k = 1 again
        if self.k == 0:
            self.pause()

    def pause(self) -> None:
        """No drafts for the next cooldown steps (then a k = 1 probe); the next cooldown doubles."""
        self.cooldown = self.next_cooldown
        self.next_cooldown = min(MAX_COOLDOWN, 2 * self.next_cooldown)

    def resume(self) -> None:
        """Drafts were given outside a probe: the next pause starts from the shortest cooldown."""
        self.next_cooldown = MIN_COOLDOWN
