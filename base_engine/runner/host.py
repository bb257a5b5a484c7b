"""What of the host this process may use: CPU features, CPUs, memory.

Containers and shared nodes give a process less than the machine has: `os.cpu_count()` counts every
core, while the scheduler lets it run on its affinity mask (`sched_setaffinity`, `taskset`, cpusets)
and CFS throttles it to its cgroup quota (v2 `cpu.max` = "<quota> <period>", v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 or "max" = none). Memory likewise: `/proc/meminfo`
(MemTotal, MemAvailable) and the cgroup limit (v2 `memory.max`, v1 `memory.limit_in_bytes`).

Each figure has a pure parser of the file's text (tested on sample contents) and a reader that
applies it to this process's files; a file that is missing or unreadable counts as "no limit".
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A cgroup v1 memory limit at or above this means "unlimited" (the kernel's page-rounded LONG_MAX).
_V1_NO_MEMORY_LIMIT = 1 << 62


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The `flags` of the first processor in /proc/cpuinfo text (x86; every core has the same)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def parse_cgroup_v2_cpu_max(text: str) -> float | None:
    """CPUs allowed by a v2 `cpu.max` ("150000 100000" -> 1.5; "max 100000" -> None)."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1])
    return quota / period if quota > 0 and period > 0 else None


def parse_cgroup_v1_cpu_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` ("-1" quota -> None)."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def parse_cgroup_path(proc_self_cgroup: str, *, controller: str) -> tuple[str, str] | None:
    """(version, path) of this process's cgroup for `controller` from /proc/self/cgroup text:
    ("v1", path) from a "N:cpu,cpuacct:/path" line, else ("v2", path) from the "0::/path" line."""
    unified = None
    for line in proc_self_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return "v1", path
        if controllers == "":
            unified = ("v2", path)
    return unified


def usable_cpus(affinity: int, quota: float | None) -> int:
    """Threads worth running: the CPUs we may be scheduled on, cut to the whole CPUs the quota pays
    for (a 1.5-CPU quota -> 1: a second busy thread would be throttled and stall the first's joins)."""
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.floor(quota)))


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo text ("MemTotal: 16318464 kB")."""
    figures = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and key in ("MemTotal", "MemAvailable"):
            figures[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" not in figures:
        raise ValueError("/proc/meminfo has no MemTotal line")
    return figures["MemTotal"], figures.get("MemAvailable", figures["MemTotal"])


def parse_cgroup_memory_limit(limit_text: str) -> int | None:
    """Bytes a cgroup may use ("max", or v1's huge sentinel -> None)."""
    text = limit_text.strip()
    if text == "max":
        return None
    limit = int(text)
    return None if limit >= _V1_NO_MEMORY_LIMIT else limit


@dataclass(frozen=True, slots=True)
class HostMemory:
    total_bytes: int  # the machine's RAM, or the cgroup limit when smaller
    available_bytes: int  # what can still be allocated without swapping or the OOM killer


def host_memory(
    meminfo: str, *, cgroup_limit: int | None = None, cgroup_usage: int | None = None
) -> HostMemory:
    """Memory this process may use: the machine's figures, cut to the cgroup's limit and what its
    members already use (page cache included, so this errs on the small side)."""
    total, available = parse_meminfo(meminfo)
    if cgroup_limit is not None:
        total = min(total, cgroup_limit)
        available = min(available, max(0, cgroup_limit - (cgroup_usage or 0)))
    return HostMemory(total_bytes=total, available_bytes=available)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_cpu_flags() -> frozenset[str]:
    return parse_cpu_flags(_read(Path("/proc/cpuinfo")) or "")


def _cgroup_dir(controller: str) -> tuple[str, Path] | None:
    found = parse_cgroup_path(_read(Path("/proc/self/cgroup")) or "", controller=controller)
    if found is None:
        return None
    version, path = found
    base = CGROUP_ROOT if version == "v2" else CGROUP_ROOT / controller
    here = base / path.lstrip("/")
    # Inside a container the namespace root is mounted at the base: the path may not exist there.
    return version, here if here.is_dir() else base


def read_cpu_quota() -> float | None:
    """CPUs this process's cgroup pays for, or None when unlimited or unknown."""
    found = _cgroup_dir("cpu")
    if found is None:
        return None
    version, directory = found
    if version == "v2":
        text = _read(directory / "cpu.max")
        return parse_cgroup_v2_cpu_max(text) if text else None
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    return parse_cgroup_v1_cpu_quota(quota, period) if quota and period else None


def read_host_memory() -> HostMemory:
    limit = usage = None
    found = _cgroup_dir("memory")
    if found is not None:
        version, directory = found
        names = ("memory.max", "memory.current") if version == "v2" else (
            "memory.limit_in_bytes", "memory.usage_in_bytes"
        )  # fmt: skip
        limit_text, usage_text = _read(directory / names[0]), _read(directory / names[1])
        limit = parse_cgroup_memory_limit(limit_text) if limit_text else None
        usage = int(usage_text) if usage_text and limit is not None else None
    return host_memory(_read(Path("/proc/meminfo")) or "", cgroup_limit=limit, cgroup_usage=usage)


def set_intra_op_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads once at engine start: `num_threads`, or the CPUs this process
    may use (affinity mask and cgroup quota); logs the choice with its figures."""
    affinity = len(os.sched_getaffinity(0))
    quota = read_cpu_quota()
    chosen = num_threads if num_threads is not None else usable_cpus(affinity, quota)
    torch.set_num_threads(chosen)
    logger.info(
        "intra-op threads: %d (%s; affinity mask %d CPUs, cgroup quota %s, os.cpu_count %s)",
        chosen,
        "configured" if num_threads is not None else "from the CPUs this process may use",
        affinity,
        "none" if quota is None else f"{quota:g} CPUs",
        os.cpu_count(),
    )
    return chosen
