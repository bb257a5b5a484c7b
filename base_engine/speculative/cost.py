"""Cost-aware k: a request is given drafts only where they are expected to pay for themselves.

With a per-token acceptance rate alpha (the chance that a draft is accepted given that the ones before
it were), k drafts emit 1 + alpha + ... + alpha^k tokens in expectation (the verified prefix plus the
sampled token), for one step whose share per request costs

    t(b, k + 1) / t(b, 1)  +  k * t_draft * b / t(b, 1)      (in decodes of that request)

where t(b, n) is the measured time of one step of b decoding requests with n new tokens each (the
`CostTable`, timed at engine start by probe.py) and t_draft the proposer's measured seconds per draft
token (about 0 for n-gram lookup, a forward of the drafter for a draft model). A request's share of a
plain decode is t(b, 1) / b, so speculating with k pays when tokens / cost > 1; `choose_k` returns
the k with the best ratio, 0 when none beats a plain decode.
"""

from __future__ import annotations

from dataclasses import dataclass

# Measuring stops at the first batch where no k pays even at this acceptance (beyond it: never).
BREAK_EVEN_ALPHA = 0.9


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify of k drafts emits in expectation: 1 + alpha + ... + alpha^k."""
    return sum(alpha**j for j in range(k + 1))


@dataclass(frozen=True, slots=True)
class CostTable:
    """seconds[b] = (t(b, 1), t(b, 2), ..., t(b, K + 1)) for the measured batch sizes b = 1, 2, 4, ...;
    off_batch: the first measured b where no k pays at BREAK_EVEN_ALPHA (None: not reached)."""

    seconds: dict[int, tuple[float, ...]]
    off_batch: int | None = None

    def row(self, batch: int) -> tuple[float, ...] | None:
        """The timings for a step of `batch` decodes: the smallest measured b >= batch (the dearer
        neighbour), the largest one past the last; None from off_batch on."""
        if self.off_batch is not None and batch >= self.off_batch:
            return None
        above = [b for b in self.seconds if b >= batch]
        return self.seconds[min(above) if above else max(self.seconds)]

    def relative_cost(self, batch: int, k: int, draft_seconds: float) -> float | None:
        """One request's share of a step with k drafts, in its share of a plain decode step."""
        row = self.row(batch)
        if row is None or k >= len(row):
            return None
        return row[k] / row[0] + k * draft_seconds * batch / row[0]


def pays_at(row: tuple[float, ...], alpha: float) -> bool:
    """Whether some k of this measured row beats a plain decode at acceptance alpha (n-gram: no
    drafter cost)."""
    return any(expected_tokens(alpha, k) > row[k] / row[0] for k in range(1, len(row)))


def choose_k(alpha: float, cap: int, batch: int, table: CostTable, draft_seconds: float) -> int:
    """The k in 0..cap with the most expected tokens per unit of cost (0: a plain decode pays best)."""
    best_k, best = 0, 1.0
    for k in range(1, cap + 1):
        cost = table.relative_cost(batch, k, draft_seconds)
        if cost is None:
            break
        ratio = expected_tokens(alpha, k) / cost
        if ratio > best:
            best_k, best = k, ratio
    return best_k
