"""Usage metering: every request billed exactly once, off the request path, surviving a crash.

The outbox pattern of ../shared/reference/platform.md, section 3.2, with a local write-ahead journal
in front of it (line format in api/metering/journal.py):

- `begin(request_id, ...)` appends a `begin` line when a request is admitted (tenant, key prefix,
  adapter, prompt tokens, start time).
- `progress(request_id, ...)` notes, in memory only, how many tokens a stream has handed to its
  client; the journal thread appends a `progress` line for every request that moved, every
  `progress_interval_s`.
- `finish(record)` appends a `finish` line with the full `UsageRecord` and buffers the record.
- The flusher thread writes the buffer (api/metering/outbox.py) to SQL every `flush_interval_s` (or as
  soon as `batch_size` records wait) through `registry.usage.write_usage`, which inserts with ON
  CONFLICT (tenant_id, request_id) DO NOTHING, so replays never double-bill. After a successful write the
  journal is compacted: a successor file holding only the requests still in flight (with their
  progress) and the records not yet written takes over, then replaces the old file.
- `flush()` writes everything now (usage reads call it first, so a read includes every request
  finished before it); `stop()` flushes and leaves the journal empty of finished requests.
- `recover()` at start-up (before `start()`) replays the journal of a previous process: `finish`
  lines are written as recorded; a request with a `begin` and no `finish` is written as aborted,
  billed its prompt and the tokens of its last journaled progress, ending at the journal's last
  modification time.

Locks. `_lock` guards the in-memory state and the journal handle; the request path only ever takes
it for a dictionary update and one buffered journal line (no fsync: api/metering/journal_file.py).

Crash bound. `begin` and `finish` lines reach the operating system before those calls return;
progress lines at most `progress_interval_s` (0.5 s) after the client was sent the tokens; the
journal thread fsyncs every `progress_interval_s`. Hence:
- the process dies (OOM kill, SIGKILL, segfault): nothing finished is lost; a request in flight is
  billed as aborted with its prompt and every token streamed to its client more than
  `progress_interval_s` before the crash (a loss of at most that much streaming per request, which
  the documented bound rounds up to 1 s); a non-streaming request in flight handed its client
  nothing and is billed its prompt;
- the machine dies (power, kernel panic): additionally, lines of the last `progress_interval_s`
  may not be on disk, so requests that began or finished then may be missing or billed by their
  last durable progress;
- a database outage: records stay buffered (and journaled) and are retried every interval; a
  clean `stop()` during an outage leaves them in the journal for the next start.
Because writes are idempotent by request id, a crash between the SQL commit and the compaction
only replays rows that already exist.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.orm import Session

from api.metering.journal import InFlightRequest, Progress, begin_line, finish_line, progress_line, replay
from api.metering.journal_file import JournalFile
from api.metering.outbox import UsageOutbox
from registry.provenance import Provenance
from registry.usage import UsageRecord

logger = logging.getLogger(__name__)

# Request ids remembered after `finish`, so a second finish of the same request (engine callback
# and route both reporting it) is ignored without growing memory without bound.
_RECENT_IDS = 100_000
PROGRESS_INTERVAL_S = 0.5
# Requests are keyed by (tenant id, request id): a client's X-Request-Id is unique only within its
# tenant (api/inference/client_id.py), as the usage table's unique key is (migration 0009).
UsageKey = tuple[str, str]


class DuplicateRequestId(Exception):
    """`begin` of a request id this tenant already has in flight (or just finished)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use by this tenant")
        self.request_id = request_id


class UsageMeter:
    def __init__(
        self,
        session_factory: Callable[[], Session],
        *,
        journal_path: Path,
        flush_interval_s: float = 1.0,
        batch_size: int = 500,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
    ) -> None:
        if flush_interval_s <= 0 or batch_size < 1 or progress_interval_s <= 0:
            raise ValueError(
                "need flush_interval_s > 0, batch_size >= 1 and progress_interval_s > 0, got "
                f"{flush_interval_s}, {batch_size}, {progress_interval_s}"
            )
        self.session_factory = session_factory
        self.journal_path = Path(journal_path)
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self.progress_interval_s = progress_interval_s
        self._lock = threading.Lock()  # journal handle, _open, _moved, the outbox's records, _recent
        self._open: dict[UsageKey, InFlightRequest] = {}
        self._moved: set[UsageKey] = set()  # open requests whose progress is not journaled yet
        self._recent: OrderedDict[UsageKey, None] = OrderedDict()
        self._journal = JournalFile(self.journal_path, self._lock)
        self._outbox = UsageOutbox(
            session_factory, batch_size=batch_size, lock=self._lock, after_batch=self._compact
        )
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def successor_path(self) -> Path:
        """Where compaction writes the journal's successor before renaming it over the journal."""
        return self._journal.successor_path

    @property
    def num_in_flight(self) -> int:
        return len(self._open)

    @property
    def num_pending(self) -> int:
        """Finished records not yet written to the database."""
        return len(self._outbox.records)

    # ---- life cycle ---------------------------------------------------------------------------

    def recover(self) -> int:
        """Bill what a previous process journaled but never wrote; returns the rows inserted.

        Call once at start-up, before `start()`. Records already in the database are skipped.
        """
        if self._journal.is_open:
            raise RuntimeError("recover() must run before start(): the journal now holds live requests")
        paths = self._journal.leftover_paths()
        if not paths:
            return 0
        records, num_aborted = replay(paths, crashed_at=self._journal.last_modified(paths))
        inserted = self._outbox.write(records)
        for path in paths:
            path.unlink()
        logger.info(
            "usage journal replayed: %d records (%d unfinished billed as aborted), %d new rows",
            len(records),
            num_aborted,
            inserted,
        )
        return inserted

    def start(self) -> None:
        """Open the journal and start the flusher (database) and journal (progress, fsync) threads."""
        if self._journal.is_open:
            raise RuntimeError("UsageMeter already started")
        self._journal.open()
        self._stopping.clear()
        self._threads = [
            threading.Thread(target=self._run_flusher, name="loraserve-usage-flusher", daemon=True),
            threading.Thread(target=self._run_journal, name="loraserve-usage-journal", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop both threads and write every buffered record (kept in the journal if that fails)."""
        self._stopping.set()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        try:
            self.flush()
        except Exception:
            logger.exception(
                "usage flush at stop failed; %d records stay in the journal", len(self._outbox.records)
            )
        self.write_progress()
        self._journal.close()

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
        user: str | None = None,
        provenance: Provenance | None = None,
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
            user=user,
            provenance=provenance,
        )
        with self._lock:
            self._require_started()
            key = (tenant_id, request_id)
            if key in self._open or key in self._recent:
                raise DuplicateRequestId(request_id)
            self._open[key] = req
            self._journal.append(begin_line(req))

    def progress(
        self, request_id: str, *, tenant_id: str, completion_tokens: int, cached_prompt_tokens: int = 0
    ) -> None:
        """Note what a running request's client has been sent so far (totals, not increments).

        Memory only, O(1): safe on the event loop for every chunk. The journal thread writes it.
        """
        with self._lock:
            key = (tenant_id, request_id)
            req = self._open.get(key)
            if req is None:  # finished already, or never begun
                return
            moved = req.with_progress(
                Progress(request_id, completion_tokens, cached_prompt_tokens, tenant_id)
            )
            if moved != req:
                self._open[key] = moved
                self._moved.add(key)

    def finish(self, record: UsageRecord) -> bool:
        """Buffer a finished request's record; False (ignored) when that request was already finished.

        Thread-safe and non-blocking apart from one buffered journal write.
        """
        with self._lock:
            self._require_started()
            key = (record.tenant_id, record.request_id)
            if key in self._recent:
                logger.warning("usage for request %s reported twice; keeping the first", record.request_id)
                return False
            self._recent[key] = None
            if len(self._recent) > _RECENT_IDS:
                self._recent.popitem(last=False)
            self._open.pop(key, None)
            self._moved.discard(key)
            self._outbox.records.append(record)
            self._journal.append(finish_line(record))
            is_full = len(self._outbox.records) >= self.batch_size
        if is_full:
            self._wake.set()
        return True

    def in_flight(self, request_id: str, *, tenant_id: str) -> InFlightRequest | None:
        return self._open.get((tenant_id, request_id))

    # ---- background work ----------------------------------------------------------------------

    def flush(self) -> int:
        """Write every record buffered when called, in batches; returns the rows inserted (not
        duplicates). Records finished meanwhile wait for the next flush."""
        return self._outbox.flush()

    def write_progress(self) -> int:
        """Append a progress line for every request that moved since the last call; returns how many."""
        with self._lock:
            if not self._journal.is_open or not self._moved:
                return 0
            lines = [progress_line(self._open[key]) for key in self._moved if key in self._open]
            self._moved.clear()
            self._journal.append("".join(lines))
        return len(lines)

    # ---- internals ----------------------------------------------------------------------------

    def _require_started(self) -> None:
        if not self._journal.is_open:
            raise RuntimeError("UsageMeter is not started (call start(), after recover())")

    def _compact(self) -> None:
        self._journal.compact(self._unbilled_lines)  # the written records leave the journal

    def _unbilled_lines(self) -> list[str]:
        """What a compacted journal starts with: open requests (with their progress) and unwritten
        records. Called under _lock by JournalFile.compact; the begin lines carry all progress."""
        lines = [begin_line(req) for req in self._open.values()]
        lines += [finish_line(rec) for rec in self._outbox.records]
        self._moved.clear()
        return lines

    def _run_flusher(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception:
                logger.exception(
                    "usage flush failed; %d records kept for the next try", len(self._outbox.records)
                )

    def _run_journal(self) -> None:
        # Never waits for the database: progress keeps being journaled through an outage.
        while not self._stopping.wait(self.progress_interval_s):
            try:
                self.write_progress()
                self._journal.fsync()
            except Exception:
                logger.exception("usage journal write failed")
