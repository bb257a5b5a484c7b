"""What of the host the engine may use (base_engine/runner/host.py): the parsers on sample contents of
/proc/cpuinfo, /proc/self/cgroup, cgroup v1/v2 CPU and memory files and /proc/meminfo, and the thread
count the engine sets at start."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from base_engine.runner.host import (
    host_memory,
    parse_cgroup_memory_limit,
    parse_cgroup_path,
    parse_cgroup_v1_cpu_quota,
    parse_cgroup_v2_cpu_max,
    parse_cpu_flags,
    parse_meminfo,
    set_intra_op_threads,
    usable_cpus,
)

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
bogomips\t: 4800.00

processor\t: 1
flags\t\t: fpu
"""

MEMINFO = """MemTotal:       24576000 kB
MemFree:        14000000 kB
MemAvailable:   18000000 kB
Buffers:          100000 kB
"""


def test_cpu_flags_come_from_the_first_processor() -> None:
    flags = parse_cpu_flags(CPUINFO)
    assert {"amx_bf16", "avx512_bf16", "avx2"} <= flags and "processor" not in flags
    assert parse_cpu_flags("processor\t: 0\n") == frozenset()


def test_cgroup_v2_cpu_max() -> None:
    assert parse_cgroup_v2_cpu_max("150000 100000\n") == 1.5
    assert parse_cgroup_v2_cpu_max("200000 100000") == 2.0
    assert parse_cgroup_v2_cpu_max("max 100000\n") is None


def test_cgroup_v1_cfs_quota() -> None:
    assert parse_cgroup_v1_cpu_quota("50000\n", "100000\n") == 0.5
    assert parse_cgroup_v1_cpu_quota("400000", "100000") == 4.0
    assert parse_cgroup_v1_cpu_quota("-1\n", "100000\n") is None


def test_cgroup_path_v1_controller_line_wins_over_the_unified_line() -> None:
    hybrid = "12:cpu,cpuacct:/kubepods/pod1/c1\n4:memory:/kubepods/pod1/c1\n0::/\n"
    assert parse_cgroup_path(hybrid, controller="cpu") == ("v1", "/kubepods/pod1/c1")
    assert parse_cgroup_path(hybrid, controller="memory") == ("v1", "/kubepods/pod1/c1")
    unified = "0::/system.slice/loraserve.service\n"
    assert parse_cgroup_path(unified, controller="cpu") == ("v2", "/system.slice/loraserve.service")
    assert parse_cgroup_path("", controller="cpu") is None


@pytest.mark.parametrize(
    ("affinity", "quota", "expected"),
    [(8, None, 8), (8, 2.0, 2), (8, 1.5, 1), (8, 0.5, 1), (2, 16.0, 2), (1, None, 1)],
)
def test_threads_are_the_cpus_we_may_run_on_cut_to_whole_cpus_of_quota(affinity, quota, expected) -> None:
    assert usable_cpus(affinity, quota) == expected


def test_meminfo_and_cgroup_memory_limit() -> None:
    assert parse_meminfo(MEMINFO) == (24576000 * 1024, 18000000 * 1024)
    with pytest.raises(ValueError, match="MemTotal"):
        parse_meminfo("MemFree: 1 kB\n")
    assert parse_cgroup_memory_limit("max\n") is None
    assert parse_cgroup_memory_limit("9223372036854771712\n") is None  # v1's "unlimited"
    assert parse_cgroup_memory_limit("4294967296\n") == 4 << 30
    mem = host_memory(MEMINFO, cgroup_limit=4 << 30, cgroup_usage=1 << 30)
    assert (mem.total_bytes, mem.available_bytes) == (4 << 30, 3 << 30)
    assert host_memory(MEMINFO).available_bytes == 18000000 * 1024


def test_engine_start_sets_threads_from_affinity_and_logs_the_figures(caplog) -> None:
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="base_engine.runner.host"):
            chosen = set_intra_op_threads(None)
        assert chosen == torch.get_num_threads() <= len(os.sched_getaffinity(0))
        assert "affinity mask" in caplog.text and "cgroup quota" in caplog.text
        assert set_intra_op_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
