"""Goodput: the share of recent requests that met the latency SLO.

The definition of DistServe (Zhong et al., OSDI 2024, "goodput"): a request counts when its time to
first token is within the TTFT SLO and its time per output token (mean inter-token latency) is
within the TPOT SLO. The window keeps the last `window_s` of finished requests; requests that
failed or were aborted before any token are not counted (they have no latency to judge).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from base_engine.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 2.0  # the CPU-sized SLO of benchmarks/serving.py
    tpot_s: float = 0.2

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO times must be > 0 s, got ttft_s={self.ttft_s}, tpot_s={self.tpot_s}")

    def is_met(self, out: RequestOutput) -> bool | None:
        """True / False for a request that produced a token; None when there is nothing to judge."""
        m = out.metrics
        if m is None or out.num_completion_tokens == 0:
            return None
        gaps = m.inter_token_s
        tpot = sum(gaps) / len(gaps) if gaps else 0.0
        return m.ttft_s <= self.ttft_s and tpot <= self.tpot_s


@dataclass(frozen=True, slots=True)
class GoodputSnapshot:
    num_requests: int  # judged requests finished in the window
    num_good: int  # of those, within the SLO

    @property
    def ratio(self) -> float | None:
        return self.num_good / self.num_requests if self.num_requests else None


class GoodputWindow:
    """Fed by `AsyncEngine.on_finished` (engine thread); read by the console (event loop)."""

    def __init__(
        self, slo: Slo | None = None, *, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.slo = slo or Slo()
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._judged: deque[tuple[float, bool]] = deque(maxlen=100_000)

    def observe(self, out: RequestOutput) -> None:
        verdict = self.slo.is_met(out)
        if verdict is None:
            return
        with self._lock:
            self._judged.append((self.clock(), verdict))

    def snapshot(self) -> GoodputSnapshot:
        oldest = self.clock() - self.window_s
        with self._lock:
            while self._judged and self._judged[0][0] < oldest:
                self._judged.popleft()
            verdicts = [ok for _, ok in self._judged]
        return GoodputSnapshot(num_requests=len(verdicts), num_good=sum(verdicts))
