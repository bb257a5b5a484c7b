"""Usage metering: every request billed exactly once, off the request path, surviving a crash.

The outbox pattern of ../shared/reference/platform.md, section 3.2, with a local write-ahead journal
in front of it:

- `begin(request_id, ...)` appends a `begin` line to an append-only JSON-lines journal when a
  request is admitted (tenant, key prefix, adapter, prompt tokens, start time).
- `finish(record)` appends a `finish` line with the full `UsageRecord` and buffers the record.
- A background thread writes the buffer to SQL every `flush_interval_s` (or as soon as
  `batch_size` records wait) through `registry.usage.write_usage`, which inserts with
  ON CONFLICT (request_id) DO NOTHING, so replays never double-bill. After a successful write the
  journal is compacted: it is rewritten to hold only the requests still in flight and the records
  not yet written.
- `flush()` writes everything now (usage reads call it first, so a read includes every request
  finished before it); `stop()` flushes and leaves the journal empty of finished requests.
- `recover()` at start-up (before `start()`) replays the journal of a previous process: `finish`
  lines are written as recorded, `begin` lines without a `finish` are written as aborted requests
  with the prompt tokens known at admission (no completion tokens, no cached tokens, ending at the
  journal's last modification time).

Crash bound. Every journal line is written to the operating system before `begin`/`finish`
returns, and fsync'd by the background thread at most `flush_interval_s` later (batched, so the
request path never waits for the disk). Hence:
- the process dies (OOM kill, SIGKILL, segfault): nothing finished is lost, and requests in flight
  are billed as aborted with their prompt tokens; the completion tokens they produced before the
  crash are lost (at most one request's generation each);
- the machine dies (power, kernel panic): additionally, requests that began or finished in the
  last `flush_interval_s` before the crash may be missing from the journal, so they are not billed;
- a database outage: records stay buffered (and journaled) and are retried every interval; a
  clean `stop()` during an outage leaves them in the journal for the next start.
Because writes are idempotent by request id, a crash between the SQL commit and the compaction
only replays rows that already exist.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from sqlalchemy.orm import Session

from api.usage_journal import InFlightRequest, begin_line, finish_line, fsync_dir, parse_line
from registry.usage import UsageRecord, write_usage

logger = logging.getLogger(__name__)

# Request ids remembered after `finish`, so a second finish of the same request (engine callback
# and route both reporting it) is ignored without growing memory without bound.
_RECENT_IDS = 100_000


class UsageMeter:
    def __init__(
        self,
        session_factory: Callable[[], Session],
        *,
        journal_path: Path,
        flush_interval_s: float = 1.0,
        batch_size: int = 500,
    ) -> None:
        if flush_interval_s <= 0 or batch_size < 1:
            raise ValueError(
                f"need flush_interval_s > 0 and batch_size >= 1, got {flush_interval_s}, {batch_size}"
            )
        self.session_factory = session_factory
        self.journal_path = Path(journal_path)
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self._lock = threading.Lock()  # journal handle, _open, _buffer, _recent
        self._flush_lock = threading.Lock()  # one flush at a time: batches commit in finish order
        self._open: dict[str, InFlightRequest] = {}
        self._buffer: list[UsageRecord] = []
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._journal: IO[str] | None = None
        self._is_dirty = False  # journal lines written since the last fsync
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def num_in_flight(self) -> int:
        return len(self._open)

    @property
    def num_pending(self) -> int:
        """Finished records not yet written to the database."""
        return len(self._buffer)

    # ---- life cycle ---------------------------------------------------------------------------

    def recover(self) -> int:
        """Bill what a previous process journaled but never wrote; returns the rows inserted.

        Call once at start-up, before `start()`. Records already in the database are skipped.
        """
        if self._journal is not None:
            raise RuntimeError("recover() must run before start(): the journal now holds live requests")
        if not self.journal_path.exists():
            return 0
        crashed_at = datetime.fromtimestamp(self.journal_path.stat().st_mtime, UTC)
        begun: dict[str, InFlightRequest] = {}
        finished: dict[str, UsageRecord] = {}
        for number, line in enumerate(self.journal_path.read_text().splitlines(), 1):
            try:
                entry = parse_line(line)
            except (ValueError, KeyError, TypeError) as exc:  # a torn last line after a crash
                logger.warning(
                    "skipping unreadable usage journal line %d of %s: %s", number, self.journal_path, exc
                )
                continue
            if isinstance(entry, InFlightRequest):
                begun[entry.request_id] = entry
            else:
                finished.setdefault(entry.request_id, entry)
        records = list(finished.values())
        records += [req.aborted(crashed_at) for rid, req in begun.items() if rid not in finished]
        inserted = self._write(records)
        self.journal_path.unlink()
        num_aborted = len(records) - len(finished)
        logger.info(
            "usage journal replayed: %d records (%d unfinished billed as aborted), %d new rows",
            len(records),
            num_aborted,
            inserted,
        )
        return inserted

    def start(self) -> None:
        """Open the journal and start the background flusher."""
        if self._journal is not None:
            raise RuntimeError("UsageMeter already started")
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        self._journal = open(self.journal_path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="loraserve-usage-flusher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the flusher and write every buffered record (kept in the journal if that fails)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.flush()
        except Exception:
            logger.exception("usage flush at stop failed; %d records stay in the journal", len(self._buffer))
        with self._flush_lock, self._lock:
            if self._journal is not None:
                self._journal.flush()
                os.fsync(self._journal.fileno())
                self._journal.close()
                self._journal = None

    # ---- the request path ---------------------------------------------------------------------

    def begin(
        self,
        request_id: str,
        *,
        tenant_id: str,
        key_prefix: str | None,
        prompt_tokens: int,
        adapter_name: str | None = None,
        adapter_version: int | None = None,
        created_at: datetime | None = None,
    ) -> None:
        """Journal an admitted request, so a crash before it finishes still bills its prompt."""
        req = InFlightRequest(
            request_id=request_id,
            tenant_id=tenant_id,
            key_prefix=key_prefix,
            adapter_name=adapter_name,
            adapter_version=adapter_version,
            prompt_tokens=prompt_tokens,
            created_at=created_at or datetime.now(UTC),
        )
        with self._lock:
            journal = self._require_started()
            if request_id in self._open or request_id in self._recent:
                raise ValueError(f"request id {request_id!r} was already metered; request ids must be unique")
            self._open[request_id] = req
            journal.write(begin_line(req))
            journal.flush()
            self._is_dirty = True

    def finish(self, record: UsageRecord) -> bool:
        """Buffer a finished request's record; False (ignored) when that request was already finished.

        Thread-safe and non-blocking apart from one buffered journal write.
        """
        with self._lock:
            journal = self._require_started()
            if record.request_id in self._recent:
                logger.warning("usage for request %s reported twice; keeping the first", record.request_id)
                return False
            self._recent[record.request_id] = None
            if len(self._recent) > _RECENT_IDS:
                self._recent.popitem(last=False)
            self._open.pop(record.request_id, None)
            self._buffer.append(record)
            journal.write(finish_line(record))
            journal.flush()
            self._is_dirty = True
            is_full = len(self._buffer) >= self.batch_size
        if is_full:
            self._wake.set()
        return True

    def in_flight(self, request_id: str) -> InFlightRequest | None:
        return self._open.get(request_id)

    def flush(self) -> int:
        """Write every buffered record now, in batches; returns the rows inserted (not duplicates)."""
        inserted = 0
        with self._flush_lock:
            while True:
                with self._lock:
                    batch = self._buffer[: self.batch_size]
                    del self._buffer[: len(batch)]
                if not batch:
                    return inserted
                try:
                    inserted += self._write(batch)
                except BaseException:
                    with self._lock:
                        self._buffer[:0] = batch  # keep finish order for the retry
                    raise
                with self._lock:
                    self._compact()

    # ---- internals ----------------------------------------------------------------------------

    def _require_started(self) -> IO[str]:
        if self._journal is None:
            raise RuntimeError("UsageMeter is not started (call start(), after recover())")
        return self._journal

    def _write(self, records: list[UsageRecord]) -> int:
        inserted = 0
        for i in range(0, len(records), self.batch_size):
            with self.session_factory() as session:
                inserted += write_usage(session, records[i : i + self.batch_size])
        return inserted

    def _compact(self) -> None:
        """Rewrite the journal as what is still unbilled: open requests and unwritten records.

        Called with `_lock` held, so no line can be appended to the old file meanwhile.
        """
        if self._journal is None:
            return
        tmp = self.journal_path.with_name(self.journal_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(begin_line(req) for req in self._open.values())
            f.writelines(finish_line(rec) for rec in self._buffer)
            f.flush()
            os.fsync(f.fileno())
        self._journal.close()
        os.replace(tmp, self.journal_path)
        fsync_dir(self.journal_path.parent)
        self._journal = open(self.journal_path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        self._is_dirty = False

    def _fsync_journal(self) -> None:
        # Under the flush lock (no compaction can swap the file) but not the state lock, so
        # `begin`/`finish` on the request path never wait for the disk.
        with self._flush_lock:
            with self._lock:
                if self._journal is None or not self._is_dirty:
                    return
                fd = self._journal.fileno()
                self._is_dirty = False
            os.fsync(fd)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            try:
                self._fsync_journal()
                self.flush()
            except Exception:
                logger.exception("usage flush failed; %d records kept for the next try", len(self._buffer))
