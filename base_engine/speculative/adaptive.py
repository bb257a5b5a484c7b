"""Adaptive k: each request's number of drafts follows its own recent acceptance.

State per request (`AdaptiveK`), updated only from verified counts, so it is a function of the
request's tokens and its drafts (no clock): an exponential average of the acceptance rate (halved
weight per verify) sets k = floor(avg * (K + 1)), clamped to [0, K]. A request whose average falls to
k = 0 proposes nothing for `cooldown` steps, then probes with k = 1; a failed probe doubles the cooldown
(MIN_COOLDOWN .. MAX_COOLDOWN), an accepted one resets it and k grows back as the average recovers.

`off_batch` (measured at engine start by probe.py) switches speculation off for a whole step when
that many requests decode at once: there a (k+1)-token verify costs about what k+1 decodes cost.
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
        if self.probing:
            self.probing = False
            if num_accepted == num_drafts:
                self.next_cooldown = MIN_COOLDOWN
                self.average = max(self.average, 1.0 / (self.max_k + 1))  # at least k = 1 again
        if self.k == 0:
            self.cooldown = self.next_cooldown
            self.next_cooldown = min(MAX_COOLDOWN, 2 * self.next_cooldown)
