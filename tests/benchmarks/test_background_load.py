"""benchmarks/background_load.py: the busy processes run, stay pinned where asked, and are gone after."""

from __future__ import annotations

import os

import pytest

from benchmarks.background_load import BackgroundLoad, read_loadavg
from tests.harness.wait import wait_for


def _cpu_ticks(pid: int) -> int:
    # /proc/<pid>/stat fields 14 and 15: user and system clock ticks (the name, field 2, has no spaces)
    fields = open(f"/proc/{pid}/stat").read().split()
    return int(fields[13]) + int(fields[14])


def test_processes_spin_pinned_round_robin_and_stop() -> None:
    cores = sorted(os.sched_getaffinity(0))
    with BackgroundLoad(len(cores) + 1, cores) as load:
        assert load.pinned_cores() == [{cores[i % len(cores)]} for i in range(len(cores) + 1)]
        pids = [p.pid for p in load.procs]
        # Each one burns CPU (a spinning loop, not a sleeping process).
        for pid in pids:
            wait_for(lambda pid=pid: _cpu_ticks(pid) > 5, timeout=60, what=f"process {pid} spinning")
        assert len(load.loadavg()) == 3
    assert load.procs == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


def test_zero_is_no_load_and_negative_is_refused() -> None:
    with BackgroundLoad(0, []) as load:
        assert load.procs == []
    with pytest.raises(ValueError, match="must be >= 0"):
        BackgroundLoad(-1, [0])
    with pytest.raises(ValueError, match="at least one core"):
        BackgroundLoad(1, [])
    assert all(x >= 0 for x in read_loadavg())
