"""Slow-disk benchmark: decode inter-token latency with a 200 ms fsync injected, over without.

    python benchmarks/slow_fsync.py --json

Starts two real `loraserve serve` processes on the same small random model: "plain", and "slow",
whose `os.fsync` sleeps `--fsync-delay-s` (0.2 s) before syncing. The delay is injected at process
level by the launcher (`python -c` replacing `os.fsync`, then `api.cli.main.main()`), with no hook in
library code; the plain server runs the same launcher with a delay of 0, so both differ only there.
(SQLite's own fsyncs, in C, are not slowed: the injection covers the usage journal, api/metering/meter.py.)

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
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The servers and their fsync launcher are in fsync_server.py, the rounds' load and figures in fsync_load.py.
from benchmarks.fsync_load import Round, run_round, summarize  # noqa: E402
from benchmarks.fsync_server import Server  # noqa: E402

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
    from base_engine.testing.checkpoint import save_random_checkpoint

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loraserve-slow-fsync-") as tmp:
        root = Path(tmp)
        model_dir = save_random_checkpoint(root / "model", **SMALL_MODEL)  # type: ignore[arg-type]
        servers = {
            "plain": Server("plain", args, model_dir, root, 0.0),
            "slow": Server("slow", args, model_dir, root, args.fsync_delay_s),
        }
        fsync_stats: dict[str, Any] = {}
        try:
            for server in servers.values():  # start both at once: imports and model load overlap
                server.wait_ready()
            startup_s = time.perf_counter() - started
            rounds = _alternating_rounds(servers, args)
        finally:
            for name, server in servers.items():
                fsync_stats[name] = server.stop()
    line = _result_line(args, rounds, fsync_stats, startup_s, started)
    if args.json:
        print(json.dumps(line))
    else:
        print(json.dumps(line, indent=2))


def _alternating_rounds(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, list[Round]]:
    """The measured rounds per server, run one server at a time (the other paused)."""
    rounds: dict[str, list[Round]] = {"plain": [], "slow": []}
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
    return rounds


def _result_line(
    args: argparse.Namespace,
    rounds: dict[str, list[Round]],
    fsync_stats: dict[str, Any],
    startup_s: float,
    started: float,
) -> dict[str, Any]:
    """The benchmark's JSON line: median of per-round p99s, slow over plain, and the diagnostics."""
    plain, slow = summarize(rounds["plain"]), summarize(rounds["slow"])
    if None in plain["p99_per_round_s"] or None in slow["p99_per_round_s"]:
        raise SystemExit(f"a round measured no gaps: {json.dumps({'plain': plain, 'slow': slow})}")
    p99_plain = statistics.median(plain["p99_per_round_s"])
    p99_slow = statistics.median(slow["p99_per_round_s"])
    ratio = p99_slow / p99_plain
    paired = [round(b / a, 3) for a, b in zip(plain["p99_per_round_s"], slow["p99_per_round_s"], strict=True)]
    return {
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


if __name__ == "__main__":
    main()
