"""Background CPU load for the benchmarks: N busy processes pinned to the engines' cores.

Shared machines (containers with CPU quotas, busy Kubernetes nodes) are where CPU serving runs; an
engine whose OpenMP regions wait on a descheduled thread collapses there. `BackgroundLoad(n, cores)`
starts n processes that spin a tight pure-Python loop (no memory traffic, so it steals cycles, not
bandwidth), process i pinned to `cores[i % len(cores)]`: with one process, one of the engine's cores
is always contended, the worst case for a barrier-synchronised thread team.

    with BackgroundLoad(1, sorted(os.sched_getaffinity(0))) as load:
        ...                      # timed rounds
        load.loadavg()           # /proc/loadavg's 1, 5, 15 minute figures, for the JSON line
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

# A tight loop that never allocates: one core's worth of pure-Python work, until killed.
SPIN = "while True:\n    pass\n"


def read_loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (/proc/loadavg), to print beside any figure."""
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


class BackgroundLoad:
    """`num` busy processes, process i pinned to `cores[i % len(cores)]`; stopped on exit."""

    def __init__(self, num: int, cores: Sequence[int]) -> None:
        if num < 0:
            raise ValueError(f"background load must be >= 0 processes, got {num}")
        if num and not cores:
            raise ValueError("background load needs at least one core to pin to, got none")
        self.num = num
        self.cores = list(cores)
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> BackgroundLoad:
        try:
            for i in range(self.num):
                proc = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL)
                self.procs.append(proc)
                os.sched_setaffinity(proc.pid, {self.cores[i % len(self.cores)]})
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def pinned_cores(self) -> list[set[int]]:
        """Each running process's affinity mask (what the kernel enforces, not what we asked)."""
        return [os.sched_getaffinity(p.pid) for p in self.procs]

    def loadavg(self) -> list[float]:
        return read_loadavg()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()
