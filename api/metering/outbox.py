"""The usage meter's outbox: finished requests' records waiting for SQL, written in batches in finish
order through `registry.usage.write_usage` (ON CONFLICT (tenant_id, request_id) DO NOTHING, so a replay never
double-bills), and put back in front, in order, when a write fails.

Separate from api/metering/meter.py, which decides when to flush (its flusher thread, `stop`, usage reads)
and keeps the requests in flight: this is the database side of the outbox pattern
(../shared/reference/platform.md, section 3.2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy.orm import Session

from registry.usage import UsageRecord, write_usage


class UsageOutbox:
    def __init__(
        self,
        session_factory: Callable[[], Session],
        *,
        batch_size: int,
        lock: threading.Lock,
        after_batch: Callable[[], None],
    ) -> None:
        """`lock`: the meter's, which guards `records` with the journal (a finished record and its
        journal line are one step); `after_batch`: called after each written batch (the meter
        compacts its journal)."""
        self.session_factory = session_factory
        self.batch_size = batch_size
        self.records: list[UsageRecord] = []  # finish order; guarded by `lock`
        self._lock = lock
        self._flush_lock = threading.Lock()  # one flush at a time: batches commit in finish order
        self._after_batch = after_batch

    def flush(self) -> int:
        """Write every record buffered when called, in batches; returns the rows inserted (not
        duplicates). Records finished meanwhile wait for the next flush."""
        inserted = 0
        with self._flush_lock:
            with self._lock:
                remaining = len(self.records)
            while remaining > 0:
                with self._lock:
                    batch = self.records[: min(self.batch_size, remaining)]
                    del self.records[: len(batch)]
                remaining -= len(batch)
                try:
                    inserted += self.write(batch)
                except BaseException:
                    with self._lock:
                        self.records[:0] = batch  # keep finish order for the retry
                    raise
                self._after_batch()
        return inserted

    def write(self, records: list[UsageRecord]) -> int:
        """Insert `records` now (`batch_size` per transaction); returns the rows that were new."""
        inserted = 0
        for i in range(0, len(records), self.batch_size):
            with self.session_factory() as session:
                inserted += write_usage(session, records[i : i + self.batch_size])
        return inserted
