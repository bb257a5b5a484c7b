"""Slow-disk benchmark: decode inter-token latency with a 200 ms fsync injected, over without (issue 12.4).

    python benchmarks/slow_fsync.py --json

Starts two real `loraserve serve` processes on the same small random model: "plain", and "slow",
whose `os.fsync` sleeps `--fsync-delay-s` (0.2 s) before syncing. The delay is injected at process
level by the launcher (`python -c` replacing `os.fsync`, then `api.cli.main()`), with no hook in
library code; the plain server runs the same launcher with a delay of 0, so both differ only there.
(SQLite's own fsyncs, in C, are not slowed: the injection covers the usage journal, api/metering.py.)

Per round, against one server: `--background` clients keep sending short chat requests
(max_tokens 1-2) so that requests keep finishing and usage journaling and its fsyncs keep happening,
while `--streams` long streaming chat requests (ignore_eos, `--max-tokens`) measure the gaps between
their token chunks on the client (each chunk carries its logprobs, so every token is one chunk).
Rounds alternate plain / slow (`--rounds` each, after one unmeasured warm-up round each); only one
server runs at a time (the other is paused with SIGSTOP), so background load on the machine hits
both alike. Reported: the median over rounds of each round's p99 inter-token gap, and
ratio = slow / plain, target <= 1.1. If the engine thread (or the event loop) waited on the disk,
every stream would stall at once for ~`--fsync-delay-s` a few times a second, far above 1 % of gaps.

`--source-dir` runs the servers from another checkout (e.g. an older commit, `git archive | tar x`)
to check that the benchmark catches an engine that blocks on fsync: commit cf27378 (observers on the
engine thread, the journal lock held across the compaction's fsync) measured ratio 4.2 (slow rounds'
p99 ~0.46 s against ~0.1 s). Diagnostics: "fsync" (which server threads called fsync, how often, for
how long), "paired_ratios" (each slow round over the plain round before it) and "others_cores" (CPU
cores other processes kept busy during each round: on a shared machine p99 is mostly their noise).
One JSON line; ~1 minute on an idle 2-core machine, ~3 with other work on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMALL_MODEL = dict(
    arch="llama",
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=352,
    vocab_size=512,
    max_position_embeddings=2048,
)
WORDS = "the quick brown fox jumps over a lazy dog while serving engines turn prompts into tokens".split()

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
from api.cli import main
main()
"""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


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


@dataclass
class Round:
    gaps_s: list[float] = field(default_factory=list)
    num_streams_ok: int = 0
    num_background: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    others_cores: float = 0.0  # CPU cores busy outside this benchmark and its server meanwhile


def _busy_ticks() -> int:
    """Busy CPU time of the whole machine, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def _process_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def _own_ticks() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * os.sysconf("SC_CLK_TCK")


def _body(rng: random.Random, max_tokens: int, stream: bool) -> dict[str, Any]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
    body: dict[str, Any] = {
        "model": "bench",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
    }
    if stream:
        # logprobs: a chunk for every token, also one that decodes to no text yet.
        body |= {"stream": True, "logprobs": True, "top_logprobs": 0}
    return body


async def long_stream(client: httpx.AsyncClient, body: dict[str, Any], out: Round) -> None:
    gaps: list[float] = []
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                out.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.errors.append(str(chunk["error"].get("message")))
                    return
                if not any((c.get("logprobs") or {}).get("content") for c in chunk["choices"]):
                    continue  # the role chunk, the usage chunk
                now = time.perf_counter()
                if last is not None:  # the first token's wait is the TTFT, not a gap
                    gaps.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        out.errors.append(f"{type(exc).__name__}: {exc}")
        return
    out.gaps_s += gaps
    out.num_streams_ok += 1


async def background(client: httpx.AsyncClient, rng: random.Random, done: asyncio.Event, out: Round) -> None:
    while not done.is_set():
        try:
            r = await client.post("/v1/chat/completions", json=_body(rng, rng.randint(1, 2), False))
            if r.status_code != 200:
                out.errors.append(f"background HTTP {r.status_code}: {r.text[:200]}")
                await asyncio.sleep(0.05)
            else:
                out.num_background += 1
        except httpx.HTTPError as exc:
            out.errors.append(f"background {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.05)


def run_round(server: Server, args: argparse.Namespace, seed: int, max_tokens: int) -> Round:
    """One round against `server`, noting how busy the rest of the machine was meanwhile."""
    before = _busy_ticks(), _process_ticks(server.proc.pid), _own_ticks()
    out = asyncio.run(_round(server, args, seed, max_tokens))
    after = _busy_ticks(), _process_ticks(server.proc.pid), _own_ticks()
    others = (after[0] - before[0]) - (after[1] - before[1]) - (after[2] - before[2])
    out.others_cores = max(0.0, others / os.sysconf("SC_CLK_TCK") / out.seconds)
    return out


async def _round(server: Server, args: argparse.Namespace, seed: int, max_tokens: int) -> Round:
    rng = random.Random(seed)
    out = Round()
    headers = {"Authorization": f"Bearer {server.api_key}"}
    n = args.streams + args.background
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=headers, timeout=300, limits=limits
    ) as client:
        done = asyncio.Event()
        start = time.perf_counter()
        workers = [
            asyncio.create_task(background(client, random.Random(rng.random()), done, out))
            for _ in range(args.background)
        ]
        await asyncio.sleep(0.3)  # requests are finishing (and being journaled) before streams start
        await asyncio.gather(
            *(long_stream(client, _body(rng, max_tokens, True), out) for _ in range(args.streams))
        )
        done.set()
        await asyncio.gather(*workers)
        out.seconds = time.perf_counter() - start
    return out


def summarize(rounds: list[Round]) -> dict[str, Any]:
    p99s = [percentile(r.gaps_s, 0.99) for r in rounds]
    all_gaps = [g for r in rounds for g in r.gaps_s]
    return {
        "p99_per_round_s": [round(p, 5) if p is not None else None for p in p99s],
        "p50_s": percentile(all_gaps, 0.50),
        "p999_s": percentile(all_gaps, 0.999),
        "max_s": max(all_gaps, default=None),
        "gaps_over_100ms": sum(g > 0.1 for g in all_gaps),
        "num_gaps": len(all_gaps),
        "streams_ok": sum(r.num_streams_ok for r in rounds),
        "background_requests": sum(r.num_background for r in rounds),
        "round_s": [round(r.seconds, 2) for r in rounds],
        "others_cores": [round(r.others_cores, 2) for r in rounds],
        "errors": sorted({e for r in rounds for e in r.errors})[:5],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--fsync-delay-s", type=float, default=0.2, help="sleep added to every os.fsync")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per server")
    p.add_argument("--streams", type=int, default=8, help="long streaming requests per round")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per long stream")
    p.add_argument("--background", type=int, default=2, help="clients looping short requests")
    p.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="torch threads per server (1: a preempted helper thread cannot stall every op)",
    )
    p.add_argument("--target", type=float, default=1.1, help="pass when p99 slow / p99 plain <= this")
    p.add_argument("--source-dir", type=Path, default=ROOT, help="checkout the servers run from")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    args.source_dir = args.source_dir.resolve()
    from base_engine.tiny_checkpoint import save_random_checkpoint

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loraserve-slow-fsync-") as tmp:
        root = Path(tmp)
        model_dir = save_random_checkpoint(root / "model", **SMALL_MODEL)  # type: ignore[arg-type]
        servers = {
            "plain": Server("plain", args, model_dir, root, 0.0),
            "slow": Server("slow", args, model_dir, root, args.fsync_delay_s),
        }
        rounds: dict[str, list[Round]] = {"plain": [], "slow": []}
        fsync_stats: dict[str, Any] = {}
        try:
            for server in servers.values():  # start both at once: imports and model load overlap
                server.wait_ready()
            startup_s = time.perf_counter() - started
            # A short unmeasured round each first warms the servers up; then plain, slow, plain, ...
            order = [name for _ in range(args.rounds + 1) for name in ("plain", "slow")]
            for i, name in enumerate(order):
                server = servers[name]
                for other in servers.values():
                    if other is not server:
                        other.pause()
                server.resume()
                max_tokens = args.max_tokens if i >= 2 else 16
                result = run_round(server, args, seed=args.seed * 1000 + i, max_tokens=max_tokens)
                if i >= 2:
                    rounds[name].append(result)
        finally:
            for name, server in servers.items():
                fsync_stats[name] = server.stop()
    plain, slow = summarize(rounds["plain"]), summarize(rounds["slow"])
    if None in plain["p99_per_round_s"] or None in slow["p99_per_round_s"]:
        raise SystemExit(f"a round measured no gaps: {json.dumps({'plain': plain, 'slow': slow})}")
    p99_plain = statistics.median(plain["p99_per_round_s"])
    p99_slow = statistics.median(slow["p99_per_round_s"])
    ratio = p99_slow / p99_plain
    paired = [round(b / a, 3) for a, b in zip(plain["p99_per_round_s"], slow["p99_per_round_s"], strict=True)]
    line = {
        "benchmark": "slow-fsync-itl",
        "fsync_delay_s": args.fsync_delay_s,
        "p99_itl_plain_s": round(p99_plain, 5),
        "p99_itl_slow_s": round(p99_slow, 5),
        "ratio": round(ratio, 3),
        "target": args.target,
        "pass": ratio <= args.target and not plain["errors"] and not slow["errors"],
        "rounds": args.rounds,
        "paired_ratios": paired,  # each slow round over the plain round just before it
        "config": {
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "background": args.background,
            "server_threads": args.server_threads,
            "model": SMALL_MODEL,
            "source_dir": str(args.source_dir),
        },
        "plain": plain,
        "slow": slow,
        "fsync": {
            name: None if s is None else {**s, "seconds": round(s["seconds"], 3)}
            for name, s in fsync_stats.items()
        },
        "startup_s": round(startup_s, 1),
        "duration_s": round(time.perf_counter() - started, 1),
    }
    if args.json:
        print(json.dumps(line))
    else:
        print(json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
