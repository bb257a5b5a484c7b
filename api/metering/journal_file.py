"""The usage meter's open journal file: appends, the journal thread's fsync, and compaction (the swap
to a successor file holding only what is still unbilled).

Separate from api/metering/meter.py, which keeps the meter's in-memory state (requests in flight, records
not yet written) and its threads: this holds the file handling, and the lock order that keeps a slow
disk off the request path. The line format is api/metering/journal.py's.

Locks. The handle and its dirty flag are guarded by the meter's lock (`lock`, shared, so a request's
state change and its journal line are one step that compaction sees whole); the request path takes
it only to append a buffered line (no fsync). `fsync` runs under `_sync_lock` alone (which the
request path never takes), so a slow disk delays durability, never a request or the engine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from api.metering.journal import fsync_dir, open_journal


class JournalFile:
    def __init__(self, path: Path, lock: threading.Lock) -> None:
        self.path = Path(path)
        self.successor_path = self.path.with_name(self.path.name + ".next")
        self._lock = lock  # the meter's lock: guards the handle and _is_dirty with the meter's state
        self._sync_lock = threading.Lock()  # fsync vs. compaction swapping the journal file
        self._file: IO[str] | None = None
        self._is_dirty = False  # journal lines written since the last fsync

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def leftover_paths(self) -> list[Path]:
        """The files a previous process left, in replay order: a crash during compaction leaves the
        old file and its successor, and the successor's lines come after the old file's."""
        return [p for p in (self.path, self.successor_path) if p.exists()]

    @staticmethod
    def last_modified(paths: list[Path]) -> datetime:
        """When the previous process last wrote (its crash time, for requests it left unfinished)."""
        return datetime.fromtimestamp(max(p.stat().st_mtime for p in paths), UTC)

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_journal(self.path)

    def append(self, text: str) -> None:
        """Write lines into the operating system (no fsync). The caller holds the meter's lock."""
        if self._file is None:
            raise RuntimeError(f"the usage journal {self.path} is not open")
        self._file.write(text)
        self._file.flush()
        self._is_dirty = True

    def compact(self, snapshot: Callable[[], list[str]]) -> None:
        """Hand the journal over to a successor holding `snapshot()`'s lines (called under the meter's
        lock: what is still unbilled); then make the successor durable and rename it over the old
        file. Lines appended meanwhile go to the successor, so none is lost; a crash before the
        rename leaves both files, and the meter's `recover` reads both."""
        with self._sync_lock:
            with self._lock:
                if self._file is None:
                    return
                successor = open_journal(self.successor_path, truncate=True)
                successor.writelines(snapshot())
                successor.flush()  # into the OS; the fsync below runs without the meter's lock
                old, self._file = self._file, successor
                self._is_dirty = True
            old.close()
            os.fsync(successor.fileno())
            os.replace(self.successor_path, self.path)
            fsync_dir(self.path.parent)

    def fsync(self) -> None:
        """Make the lines appended so far durable (the journal thread, every progress interval)."""
        with self._sync_lock:  # no compaction can close the file meanwhile
            with self._lock:
                if self._file is None or not self._is_dirty:
                    return
                fd = self._file.fileno()
                self._is_dirty = False
            os.fsync(fd)

    def close(self) -> None:
        """Flush, fsync and close (at stop); later appends fail until `open` again."""
        with self._sync_lock:
            with self._lock:
                journal, self._file = self._file, None
            if journal is not None:
                journal.flush()
                os.fsync(journal.fileno())
                journal.close()
