"""Losing less on a crash: a kill -9 loses at most ~1 s of streamed tokens per request (the
journal records each stream's progress), the journal's fsync never holds the lock the request path
takes, and a stream cut by SIGTERM still gets its usage chunk before `[DONE]`.

Oracles: the tokens the client counted (logprobs name every token) with the time it received them,
the usage chunk the client received against the record read back from the database, and a fsync
that never returns until the test lets it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session

from api.metering.meter import UsageMeter
from registry.db import make_engine, session_factory
from registry.usage import UsageRecord, export_usage
from tests.harness.servers import ADMIN_KEY, ServerProcess, bearer, main_server_args
from tests.harness.usage import REPO_ROOT, begin, record, stored

BASE = "tiny-llama"
LONG_LEN = 2048  # the tiny Llama's context: long enough that a stream is still running when it is cut
BOUND_S = 1.0  # the documented crash bound (api/metering/meter.py)


def test_fsync_never_holds_the_lock_of_the_request_path(
    sqlite_session: Callable[[], Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meter = UsageMeter(sqlite_session, journal_path=tmp_path / "usage.journal", flush_interval_s=3600)
    meter.start()
    begin(meter, record(0))
    meter.finish(record(0))  # a record to write, so flush() compacts the journal
    in_fsync, disk_back = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def stuck_fsync(fd: int) -> None:  # a disk that takes as long as the test wants
        in_fsync.set()
        disk_back.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", stuck_fsync)
    flusher = threading.Thread(target=meter.flush)
    flusher.start()
    served = threading.Event()

    def request_path() -> None:
        for i in (1, 2):
            begin(meter, record(i))
            meter.finish(record(i))
        served.set()

    try:
        assert in_fsync.wait(10), "compaction never synced the journal"
        threading.Thread(target=request_path, daemon=True).start()
        assert served.wait(5), "begin/finish waited for a fsync"
    finally:
        disk_back.set()
        flusher.join(30)
    monkeypatch.setattr(os, "fsync", real_fsync)
    meter.stop()
    assert set(stored(sqlite_session)) == {"req-0", "req-1", "req-2"}


_CRASHING_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from api.metering.meter import UsageMeter
    from registry.db import make_engine, session_factory
    from tests.harness.usage import begin, record

    meter = UsageMeter(session_factory(make_engine(sys.argv[1])), journal_path=Path(sys.argv[2]),
                       flush_interval_s=3600, progress_interval_s=0.05)
    meter.start()
    for i in range(4):
        begin(meter, record(i))
    meter.progress("req-0", tenant_id="tb", completion_tokens=10, cached_prompt_tokens=4)
    meter.progress("req-1", tenant_id="ta", completion_tokens=7)
    time.sleep(0.3)  # journaled by the meter's thread
    meter.finish(record(3))
    meter.flush()  # writes req-3 and compacts: the successor journal carries the progress so far
    meter.progress("req-0", tenant_id="tb", completion_tokens=40, cached_prompt_tokens=4)
    time.sleep(0.3)
    meter.progress("req-0", tenant_id="tb", completion_tokens=45)  # noted, never journaled: crash first
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.slow
def test_recovery_bills_the_journaled_progress(
    sqlite_session: Callable[[], Session],
    tmp_path: Path,
) -> None:
    journal = tmp_path / "usage.journal"
    db_url = f"sqlite:///{tmp_path / 'usage.db'}"
    child = subprocess.run(
        [sys.executable, "-c", _CRASHING_CHILD, db_url, str(journal)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert UsageMeter(sqlite_session, journal_path=journal).recover() == 3
    rows = stored(sqlite_session)
    billed = {rid: (r.finish_reason, r.completion_tokens, r.cached_prompt_tokens) for rid, r in rows.items()}
    assert billed == {
        "req-0": ("abort", 40, 4),  # its last journaled progress (45 was noted 0 s before the crash)
        "req-1": ("abort", 7, 0),
        "req-2": ("abort", 0, 0),
        "req-3": ("stop", record(3).completion_tokens, record(3).cached_prompt_tokens),
    }
    assert rows["req-0"].prompt_tokens == record(0).prompt_tokens


def test_a_crash_during_compaction_leaves_both_journals_and_loses_nothing(
    sqlite_session: Callable[[], Session],
    tmp_path: Path,
) -> None:
    from api.metering.journal import InFlightRequest, Progress, begin_line, finish_line, progress_line

    journal = tmp_path / "usage.journal"
    meter = UsageMeter(sqlite_session, journal_path=journal)
    a, b, c = (record(i) for i in range(3))
    running = InFlightRequest(
        request_id=a.request_id, tenant_id=a.tenant_id, key_prefix=a.key_prefix, adapter_name=a.adapter_name,
        adapter_version=a.adapter_version, prompt_tokens=a.prompt_tokens, created_at=a.created_at,
    )  # fmt: skip

    def at(n: int) -> Any:
        return running.with_progress(Progress(running.request_id, n, 0))

    # A crash between "successor written" and "renamed over the old file": both files are there.
    journal.write_text(begin_line(running) + finish_line(b) + progress_line(at(3)))
    meter.successor_path.write_text(begin_line(at(5)) + finish_line(c))
    assert meter.recover() == 3
    rows = stored(sqlite_session)
    assert (rows["req-0"].finish_reason, rows["req-0"].completion_tokens) == ("abort", 5)
    assert rows["req-1"] == b and rows["req-2"] == c
    assert not journal.exists() and not meter.successor_path.exists()


# ---- real servers -------------------------------------------------------------------------------


def _records(data_dir: Path, tenant_id: str) -> list[UsageRecord]:
    engine = make_engine(f"sqlite:///{data_dir / 'loraserve.db'}")
    try:
        with session_factory(engine)() as session:
            return export_usage(session, tenant_id=tenant_id, limit=10_000).records
    finally:
        engine.dispose()


def _server(tmp_path: Path, tiny_llama_dir: Path, *extra: str, **env: str) -> ServerProcess:
    args = main_server_args(tiny_llama_dir) + ["--max-model-len", str(LONG_LEN), *extra]  # the last wins
    return ServerProcess(args, tmp_path / "data", env={"LORASERVE_ADMIN_KEY": ADMIN_KEY, **env})


def _tenant(process: ServerProcess) -> dict[str, Any]:
    r = httpx.post(f"{process.base_url}/admin/api/tenants", json={"name": "crash"}, headers=bearer(ADMIN_KEY))
    assert r.status_code == 201, r.text
    return r.json()


def _events(r: httpx.Response) -> Any:
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


@pytest.mark.slow
def test_kill_9_mid_stream_bills_what_was_streamed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Journal only (nothing reaches the database before the crash): the restart replays it.
    process = _server(tmp_path, tiny_llama_dir, LORASERVE_USAGE_FLUSH_INTERVAL_S="3600").start()
    tenant = _tenant(process)
    body = {"model": BASE, "prompt": "Count", "max_tokens": LONG_LEN - 16, "ignore_eos": True, "logprobs": 0}
    received: list[tuple[float, int]] = []  # (time, tokens received so far)
    url, headers = f"{process.base_url}/v1/completions", {"Authorization": f"Bearer {tenant['api_key']}"}
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        total = 0
        for event in _events(r):
            assert event != "[DONE]", "the stream ended before the crash: make it longer"
            total += len(event["choices"][0]["logprobs"]["tokens"])
            received.append((time.monotonic(), total))
            if total >= 100 and received[-1][0] - next(t for t, n in received if n >= 100) > 1.5:
                break  # 1.5 s of streaming after the first 100 tokens
        crashed_at = time.monotonic()
        process.stop(signal.SIGKILL)
    assert process.proc is not None and process.proc.returncode == -signal.SIGKILL
    process.start()  # replays the journal
    assert process.stop() == 0
    records = [r for r in _records(process.data_dir, tenant["id"]) if r.request_id == request_id]
    assert len(records) == 1, records
    billed = records[0]
    streamed_before_bound = max(n for t, n in received if t <= crashed_at - BOUND_S)
    assert billed.finish_reason == "abort" and billed.prompt_tokens >= 1
    # Everything streamed more than the bound before the crash is billed; nothing beyond what ran.
    assert streamed_before_bound <= billed.completion_tokens <= LONG_LEN, (
        streamed_before_bound,
        billed.completion_tokens,
        received[-1],
    )


@pytest.mark.slow
def test_sigterm_cut_stream_gets_its_usage_chunk_before_done(tiny_llama_dir: Path, tmp_path: Path) -> None:
    process = _server(tmp_path, tiny_llama_dir, "--drain-timeout-s", "0.3").start()
    tenant = _tenant(process)
    body = {
        "model": BASE, "prompt": "Count", "max_tokens": 1500, "ignore_eos": True, "n": 2,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    url, headers = f"{process.base_url}/v1/completions", {"Authorization": f"Bearer {tenant['api_key']}"}
    events: list[Any] = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        stream = _events(r)
        for event in stream:
            events.append(event)
            if len(events) == 10:
                assert process.proc is not None
                process.proc.send_signal(signal.SIGTERM)  # cut after the 0.3 s grace
        assert events[-1] == "[DONE]"
    assert process.proc is not None and process.proc.wait(60) == 0
    error, usage_chunk = events[-2], events[-3]
    assert error["error"]["code"] == "shutting_down", events[-4:]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0, usage_chunk
    assert all(e["usage"] is None for e in events[:-3]), "usage is null on every chunk but the last"
    usage = usage_chunk["usage"]
    [billed] = [r for r in _records(process.data_dir, tenant["id"]) if r.request_id == request_id]
    assert (billed.prompt_tokens, billed.cached_prompt_tokens, billed.completion_tokens) == (
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"],
    )  # fmt: skip
    assert billed.finish_reason == "abort"
