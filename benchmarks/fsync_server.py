"""slow_fsync.py's servers: `loraserve serve` started through a `python -c` launcher that replaces
`os.fsync` with one that sleeps first (0 s for the plain server) and writes, at exit, which threads
called fsync and for how long; pausable with SIGSTOP so only one server runs at a time."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

# The server launcher: `os.fsync` slowed by LORASERVE_BENCH_FSYNC_DELAY_S seconds (0: unchanged);
# calls and the time spent in them are written to LORASERVE_BENCH_FSYNC_STATS at exit.
LAUNCHER = """
import atexit, json, os, sys, threading, time
_delay = float(os.environ["LORASERVE_BENCH_FSYNC_DELAY_S"])
_real_fsync = os.fsync
_stats = {"calls": 0, "seconds": 0.0, "threads": {}}
_lock = threading.Lock()
def _slow_fsync(fd):
    start = time.perf_counter()
    if _delay > 0:
        time.sleep(_delay)
    _real_fsync(fd)
    with _lock:
        _stats["calls"] += 1
        _stats["seconds"] += time.perf_counter() - start
        name = threading.current_thread().name
        _stats["threads"][name] = _stats["threads"].get(name, 0) + 1
os.fsync = _slow_fsync
def _dump():
    with open(os.environ["LORASERVE_BENCH_FSYNC_STATS"], "w") as f:
        json.dump(_stats, f)
atexit.register(_dump)
sys.argv = ["loraserve", "serve", *sys.argv[1:]]
from api.cli.main import main
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`loraserve serve` through LAUNCHER in a subprocess, with an admin key and one tenant."""

    def __init__(self, name: str, args: argparse.Namespace, model_dir: Path, root: Path, delay_s: float):
        self.name = name
        self.root = root / name
        self.root.mkdir()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.admin_key = f"lsa-{uuid.uuid4().hex}"
        self.stats_path = self.root / "fsync-stats.json"
        self.log_path = self.root / "server.log"
        self.api_key = ""
        self.paused = False
        serve = [
            "--model", str(model_dir), "--served-model-name", "bench", "--data-dir", str(self.root / "data"),
            "--port", str(self.port), "--num-kv-blocks", "1024", "--max-num-seqs", "32",
            "--max-model-len", "1024",
        ]  # fmt: skip
        env = {
            **os.environ,
            "LORASERVE_ADMIN_KEY": self.admin_key,
            "LORASERVE_LOG_LEVEL": "warning",
            "LORASERVE_BENCH_FSYNC_DELAY_S": str(delay_s),
            "LORASERVE_BENCH_FSYNC_STATS": str(self.stats_path),
            "OMP_NUM_THREADS": str(args.server_threads),
            "MKL_NUM_THREADS": str(args.server_threads),
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCHER, *serve],
                cwd=args.source_dir,  # `python -c` imports from its working directory first
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise RuntimeError(f"{self.name} server not ready in {timeout_s} s:\n{self.log()}")
        r = httpx.post(
            f"{self.base_url}/admin/api/tenants",
            headers={"Authorization": f"Bearer {self.admin_key}"},
            json={"name": "bench"},
            timeout=60,
        )
        r.raise_for_status()
        self.api_key = r.json()["api_key"]

    def pause(self) -> None:
        if not self.paused and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.proc.send_signal(signal.SIGCONT)
            self.paused = False

    def stop(self) -> dict[str, Any] | None:
        """SIGTERM (a clean drain, so the fsync stats get written); returns those stats."""
        self.resume()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return None
