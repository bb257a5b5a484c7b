"""What the request path tells the metrics: one call when an HTTP request has ended.

`Metrics` (api/metrics/prometheus.py) counts it; `NoMetrics` ignores it (a server or test built
without metrics).
"""

from __future__ import annotations

from typing import Protocol

from api.context import RequestContext
from base_engine.outputs import RequestOutput


class MetricsRecorder(Protocol):
    def request_finished(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        """Count an HTTP request's engine requests (final outputs in choice order); engine dispatcher."""


class NoMetrics:
    def request_finished(self, ctx: RequestContext, finals: list[RequestOutput]) -> None:
        return None
