"""HTTP serving benchmark: Poisson arrivals, adapters drawn Zipf, streaming chat completions.

    python benchmarks/serving.py --json                  # starts its own server on a small random model
    python benchmarks/serving.py --json --base-url http://127.0.0.1:8000 --api-key lsk-... \
        --model loraserve-demo --adapters demo-qv-r8,demo-all-r4       # against a running server

Reports time to first token, inter-token latency (gaps between streamed chunks) and end-to-end
latency at p50/p95/p99, output tokens per second, and goodput: requests per second that met the
SLO (TTFT <= --slo-ttft-s and mean ITL <= --slo-itl-s; defaults 2 s / 200 ms for CPU), as in
DistServe's definition. Output lengths are fixed (ignore_eos), so runs compare. One JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lora_workload import zipf_assign  # noqa: E402

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


@dataclass
class Result:
    ok: bool = False
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> Result:
    result = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in chunk["choices"]):
                    now = time.perf_counter()
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = True
    return result


async def run_load(
    args: argparse.Namespace, base_url: str, api_key: str, models: list[str]
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    choice = zipf_assign(args.num_requests, len(models), seed=args.seed, s=args.zipf_s)
    gaps = [rng.expovariate(args.rate) for _ in range(args.num_requests)]
    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=args.num_requests, max_keepalive_connections=args.num_requests)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i in range(args.num_requests):
            await asyncio.sleep(gaps[i])
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*args.prompt_words)))
            body = {
                "model": models[choice[i]],
                "messages": [{"role": "user", "content": words}],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0.8,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.create_task(one_request(client, body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, results, duration)


def summarize(args: argparse.Namespace, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    mean_itl = [sum(r.itl_s) / len(r.itl_s) if r.itl_s else 0.0 for r in ok]
    good = sum(
        1
        for r, itl in zip(ok, mean_itl, strict=True)
        if r.ttft_s <= args.slo_ttft_s and itl <= args.slo_itl_s
    )
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "output_tok_s": output_tokens / duration,
        "request_rps": len(ok) / duration,
        "goodput_rps": good / duration,
        "goodput_frac": good / max(1, len(results)),
        "slo": {"ttft_s": args.slo_ttft_s, "mean_itl_s": args.slo_itl_s},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnServer:
    """A `loraserve serve` subprocess on a small random model in a temp dir, with N uploaded adapters."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        from base_engine.testing.checkpoint import save_random_checkpoint

        self.root = root
        self.model_dir = save_random_checkpoint(root / "model", **SMALL_MODEL)  # type: ignore[arg-type]
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.admin_key = f"lsa-{uuid.uuid4().hex}"
        cmd = [
            str(Path(sys.executable).with_name("loraserve")), "serve", "--model", str(self.model_dir),
            "--served-model-name", "bench", "--data-dir", str(root / "data"), "--port", str(self.port),
            "--num-kv-blocks", "1024", "--max-loras", str(args.max_loras), "--max-num-seqs", "32",
        ]  # fmt: skip
        env = {**os.environ, "LORASERVE_ADMIN_KEY": self.admin_key, "LORASERVE_LOG_LEVEL": "warning"}
        self.log = open(root / "server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("server not ready in time")

    def tenant_with_adapters(self, num: int) -> tuple[str, list[str]]:
        from adapters.testing import save_random_adapter
        from base_engine.model.config import load_model_config

        admin = {"Authorization": f"Bearer {self.admin_key}"}
        r = httpx.post(
            f"{self.base_url}/admin/api/tenants", headers=admin, json={"name": "bench"}, timeout=60
        )
        r.raise_for_status()
        api_key = r.json()["api_key"]
        shapes = load_model_config(self.model_dir).base_shapes()
        names = []
        for i in range(num):
            adapter = save_random_adapter(self.root / f"adapter{i}", shapes, rank=8, alpha=16, seed=i)
            files = [("files", (p.name, p.read_bytes())) for p in sorted(adapter.iterdir())]
            r = httpx.post(
                f"{self.base_url}/v1/adapters",
                headers={"Authorization": f"Bearer {api_key}"},
                data={"name": f"adapter{i}"},
                files=files,
                timeout=120,
            )
            r.raise_for_status()
            names.append(f"adapter{i}")
        return api_key, names

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--base-url", help="a running server (default: start one on a small random model)")
    p.add_argument("--api-key", help="tenant key for --base-url")
    p.add_argument("--model", default="bench", help="base model name for --base-url")
    p.add_argument("--adapters", default="", help="comma-separated adapter names for --base-url")
    p.add_argument("--num-adapters", type=int, default=4, help="adapters uploaded to the own server")
    p.add_argument("--max-loras", type=int, default=4, help="GPU adapter slots of the own server")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, nargs=2, default=(8, 48))
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-itl-s", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    config = {k: v for k, v in vars(args).items() if k not in ("json", "api_key")}
    if args.base_url:
        if not args.api_key:
            raise SystemExit("--base-url needs --api-key (a tenant key)")
        models = [m for m in args.adapters.split(",") if m] or [args.model]
        report = asyncio.run(run_load(args, args.base_url, args.api_key, models))
    else:
        with tempfile.TemporaryDirectory(prefix="loraserve-bench-") as tmp:
            server = OwnServer(args, Path(tmp))
            try:
                server.wait_ready()
                api_key, models = server.tenant_with_adapters(args.num_adapters)
                report = asyncio.run(run_load(args, server.base_url, api_key, models))
            finally:
                server.stop()
    line = {"benchmark": "serving", "config": config, **report}
    if args.json:
        print(json.dumps(line))
    else:
        print(json.dumps(line, indent=2))


if __name__ == "__main__":
    main()
