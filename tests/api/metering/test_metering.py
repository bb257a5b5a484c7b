"""UsageMeter: batched, idempotent writes; flush on stop; a journal that survives a real crash.

Runs on SQLite and PostgreSQL (`db_url`); the crash test kills a child process with SIGKILL
mid-run, so nothing of its in-memory state survives, and a new meter recovers from the journal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from api.metering.meter import DuplicateRequestId, UsageMeter
from registry.db import make_engine, session_factory
from registry.usage import UsageRecord, export_usage, is_request_id_used
from tests.harness.usage import REPO_ROOT, begin, record, stored
from tests.harness.wait import wait_for


def test_flush_writes_each_request_once(make_session: Callable[[], Session], tmp_path: Path) -> None:
    meter = UsageMeter(make_session, journal_path=tmp_path / "usage.journal", flush_interval_s=3600)
    meter.start()
    records = [record(i) for i in range(12)]
    for r in records:
        begin(meter, r)
    assert meter.num_in_flight == 12
    for r in records:
        assert meter.finish(r)
    assert not meter.finish(record(3, completion_tokens=999))  # a second report of req-3 is ignored
    assert meter.num_in_flight == 0 and meter.num_pending == 12
    assert stored(make_session) == {}  # nothing is written on the request path
    assert meter.flush() == 12
    assert stored(make_session) == {r.request_id: r for r in records}  # exact round trip
    assert meter.flush() == 0
    meter.stop()
    # A replay of the same ids (a retry after a crash) inserts nothing and changes nothing.
    again = UsageMeter(make_session, journal_path=tmp_path / "other.journal")
    again.start()
    for r in records:
        again.finish(UsageRecord(**{**_fields(r), "completion_tokens": 0}))
    assert again.flush() == 0
    again.stop()
    assert stored(make_session) == {r.request_id: r for r in records}


def _fields(r: UsageRecord) -> dict[str, object]:
    return {name: getattr(r, name) for name in UsageRecord.__dataclass_fields__}


def test_full_batch_is_written_in_the_background_and_stop_flushes_the_rest(
    make_session: Callable[[], Session], tmp_path: Path
) -> None:
    journal = tmp_path / "usage.journal"
    meter = UsageMeter(make_session, journal_path=journal, flush_interval_s=3600, batch_size=4)
    meter.start()
    for i in range(4):
        meter.finish(record(i))
    # The interval is an hour: only a full batch can have woken the flusher.
    wait_for(lambda: len(stored(make_session)) == 4, 10.0, interval=0.02)
    for i in range(4, 6):
        meter.finish(record(i))
    time.sleep(0.2)
    assert meter.num_pending == 2  # not a full batch: waits for the interval (or stop)
    assert set(stored(make_session)) == {f"req-{i}" for i in range(4)}
    meter.stop()
    assert set(stored(make_session)) == {f"req-{i}" for i in range(6)}
    assert journal.read_text() == ""  # compacted: nothing left unbilled


def test_interval_flush_and_concurrent_finishers(
    sqlite_session: Callable[[], Session], tmp_path: Path
) -> None:
    meter = UsageMeter(sqlite_session, journal_path=tmp_path / "j", flush_interval_s=0.05, batch_size=7)
    meter.start()

    def worker(base: int) -> None:
        for i in range(base, base + 50):
            meter.finish(record(i))

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: len(stored(sqlite_session)) == 200, 10.0, interval=0.02)
    meter.stop()
    assert len(stored(sqlite_session)) == 200


_CRASHING_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from api.metering.meter import UsageMeter
    from registry.db import make_engine, session_factory
    from tests.harness.usage import begin, record

    meter = UsageMeter(session_factory(make_engine(sys.argv[1])), journal_path=Path(sys.argv[2]),
                       flush_interval_s=3600)
    meter.start()
    for i in range(5):
        begin(meter, record(i))
    meter.finish(record(0))
    meter.flush()  # req-0 reaches the database
    meter.finish(record(1))  # finished, still buffered
    meter.finish(record(2, finish_reason="abort", completion_tokens=1))
    # req-3 and req-4 are in flight when the process dies.
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_recover_after_a_crash_bills_each_request_once(
    make_session: Callable[[], Session], db_url: str, tmp_path: Path
) -> None:
    journal = tmp_path / "usage.journal"
    child = subprocess.run(
        [sys.executable, "-c", _CRASHING_CHILD, db_url, str(journal)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert set(stored(make_session)) == {"req-0"}

    meter = UsageMeter(make_session, journal_path=journal)
    assert meter.recover() == 4  # req-0 is already there: not written twice
    rows = stored(make_session)
    assert set(rows) == {f"req-{i}" for i in range(5)}
    assert rows["req-0"] == record(0) and rows["req-1"] == record(1)
    assert rows["req-2"] == record(2, finish_reason="abort", completion_tokens=1)
    for i in (3, 4):  # in flight at the crash: aborted, billed for the prompt known at admission
        expected = record(i)
        got = rows[f"req-{i}"]
        assert (got.finish_reason, got.completion_tokens, got.cached_prompt_tokens) == ("abort", 0, 0)
        assert (got.tenant_id, got.key_prefix, got.adapter_name, got.adapter_version) == (
            expected.tenant_id, expected.key_prefix, expected.adapter_name, expected.adapter_version,
        )  # fmt: skip
        assert got.prompt_tokens == expected.prompt_tokens and got.created_at == expected.created_at
        assert got.finished_at >= got.created_at and got.ttft_s is None
    assert meter.recover() == 0  # the journal is consumed
    meter.start()
    meter.stop()
    assert len(stored(make_session)) == 5


def test_replaying_a_journal_already_written_adds_nothing(
    sqlite_session: Callable[[], Session], tmp_path: Path
) -> None:
    # A crash between the SQL commit and the journal compaction replays rows that exist.
    journal = tmp_path / "usage.journal"
    meter = UsageMeter(sqlite_session, journal_path=journal, flush_interval_s=3600)
    meter.start()
    for i in range(3):
        begin(meter, record(i))
        meter.finish(record(i))
    before_compaction = journal.read_bytes()
    meter.stop()
    journal.write_bytes(before_compaction + b'{"op": "finish", "record": {"request_')  # torn last line
    again = UsageMeter(sqlite_session, journal_path=journal)
    assert again.recover() == 0
    assert stored(sqlite_session) == {f"req-{i}": record(i) for i in range(3)}


def test_database_outage_keeps_records_for_the_next_start(
    sqlite_session: Callable[[], Session], tmp_path: Path
) -> None:
    broken = make_engine(f"sqlite:///{tmp_path / 'never-migrated.db'}")  # no usage table: inserts fail
    journal = tmp_path / "usage.journal"
    meter = UsageMeter(session_factory(broken), journal_path=journal, flush_interval_s=3600)
    meter.start()
    meter.finish(record(1))
    meter.finish(record(2))
    with pytest.raises(Exception, match="usage_records"):
        meter.flush()
    assert meter.num_pending == 2  # kept for the next try
    meter.stop()  # logs the failure; the records stay journaled
    broken.dispose()
    recovered = UsageMeter(sqlite_session, journal_path=journal)
    assert recovered.recover() == 2
    assert stored(sqlite_session) == {"req-1": record(1), "req-2": record(2)}


def test_misuse_is_refused(sqlite_session: Callable[[], Session], tmp_path: Path) -> None:
    meter = UsageMeter(sqlite_session, journal_path=tmp_path / "j")
    with pytest.raises(RuntimeError, match="not started"):
        begin(meter, record(1))
    meter.start()
    with pytest.raises(RuntimeError, match="before start"):
        meter.recover()
    begin(meter, record(1))
    with pytest.raises(DuplicateRequestId, match="req-1"):
        begin(meter, record(1))
    begin(meter, record(1, tenant_id="another"))  # request ids are unique within a tenant only
    meter.stop()
    with pytest.raises(ValueError, match="batch_size"):
        UsageMeter(sqlite_session, journal_path=tmp_path / "j", batch_size=0)


def test_one_request_id_in_two_tenants_is_billed_once_in_each(
    make_session: Callable[[], Session], tmp_path: Path
) -> None:
    """A client's X-Request-Id is unique within its tenant: the key is (tenant, request id), in memory,
    in the journal's replay and in the table's unique constraint (migration 0009)."""
    journal = tmp_path / "usage.journal"
    meter = UsageMeter(make_session, journal_path=journal, flush_interval_s=3600)
    meter.start()
    mine, theirs = (
        record(1, request_id="chatcmpl-job-7"),
        record(1, request_id="chatcmpl-job-7", tenant_id="tz"),
    )
    begin(meter, mine)
    begin(meter, theirs)
    meter.progress(theirs.request_id, tenant_id="tz", completion_tokens=5)
    assert meter.in_flight(mine.request_id, tenant_id=mine.tenant_id) is not None
    assert meter.finish(mine)
    assert not meter.finish(mine)  # a second report is still ignored
    assert meter.flush() == 1
    meter.write_progress()
    # a crash now: the other tenant's request is in the journal only, and replays as its own abort
    crashed = UsageMeter(make_session, journal_path=journal, flush_interval_s=3600)
    assert crashed.recover() == 1
    with make_session() as session:
        rows = export_usage(session, limit=100).records
        assert is_request_id_used(session, tenant_id="tz", request_id="chatcmpl-job-7")
        assert not is_request_id_used(session, tenant_id="nobody", request_id="chatcmpl-job-7")
    billed = {(r.tenant_id, r.request_id): r for r in rows}
    assert len(rows) == 2 and set(billed) == {(mine.tenant_id, mine.request_id), ("tz", mine.request_id)}
    assert billed[mine.tenant_id, mine.request_id].finish_reason == "stop"
    assert billed["tz", mine.request_id].finish_reason == "abort"
    assert billed["tz", mine.request_id].completion_tokens == 5
