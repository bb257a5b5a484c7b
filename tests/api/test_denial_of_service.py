"""Denial of service, against real server processes: a hostile regex in an upload, a hung
object store, one tenant flooding the admission slots (uploads amplifying memory:
test_denial_of_service_memory.py).

Each test names the figure it checks. Shared helpers: tests/api/dos_helpers.py.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.api.dos_helpers import Poller, timed
from tests.harness.hanging_proxy import HangingProxy
from tests.harness.s3 import s3_client
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, bearer, launch_server, main_server_args
from tests.harness.uploads import CONFIG, files_of, peft_adapter, upload

pytestmark = pytest.mark.slow  # real servers

EVIL = "(.|.){0,24}Z"  # 2^24 backtracking steps per module name for Python's re (71 s once)


# ---- 1. regex DoS ------------------------------------------------------------------------------


def test_hostile_regex_upload_validates_fast_and_health_stays_responsive(
    server: Server, tmp_path: Path
) -> None:
    _, key = server.tenant("regex")
    files = files_of(peft_adapter(tmp_path / "a"))
    config = json.loads(files[CONFIG])
    # Accepts the adapter's own projections; Python's re would backtrack 2^24 ways on every other name.
    config["target_modules"] = r"model\.layers\.\d+\.(self_attn\.(q|v)|mlp\.down)_proj|" + EVIL
    hostile = {**files, CONFIG: json.dumps(config).encode()}
    refused = {**files, CONFIG: json.dumps({**config, "target_modules": EVIL}).encode()}
    with Poller(f"{server.base_url}/health") as health:
        time.sleep(0.2)
        accepted_s, accepted = timed(lambda: upload(server, key, "hostile", hostile))
        refused_s, refusal = timed(lambda: upload(server, key, "refused", refused))
        time.sleep(0.2)
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["modules"] == ["q_proj", "v_proj", "down_proj"]
    assert refusal.status_code == 400 and "targets no projection" in refusal.json()["error"]["message"]
    # The whole upload (HTTP, validation, store, database) in well under the 71 s Python's re once took.
    assert accepted_s < 3.0 and refused_s < 3.0, (accepted_s, refused_s)
    assert health.statuses and set(health.statuses) == {200}
    assert max(health.latencies) < 1.0, max(health.latencies)


# ---- 2. a hung object store ---------------------------------------------------------------------

HUNG_UPLOAD_TIMEOUT_S = 8.0


@pytest.fixture
def hung_store_server(
    s3_server: str, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[tuple[Server, HangingProxy]]:
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }
    bucket = f"hang-{uuid.uuid4().hex[:20]}"
    s3_client({**env, "AWS_ENDPOINT_URL": s3_server}).create_bucket(Bucket=bucket)
    with HangingProxy(s3_server) as proxy:
        env |= {
            "AWS_ENDPOINT_URL": proxy.url,
            "LORASERVE_ADMIN_KEY": ADMIN_KEY,
            "LORASERVE_STORE_CONNECT_TIMEOUT_S": "1",
            "LORASERVE_STORE_READ_TIMEOUT_S": "1",
            "LORASERVE_STORE_MAX_ATTEMPTS": "2",
            "LORASERVE_UPLOAD_TIMEOUT_S": str(HUNG_UPLOAD_TIMEOUT_S),
            "LORASERVE_READY_TIMEOUT_S": "1",
            "LORASERVE_MAX_CONCURRENT_UPLOADS": "2",
        }
        args = [*main_server_args(tiny_llama_dir), "--registry", f"s3://{bucket}/registry"]
        process = ServerProcess(args, tmp_path / "data", env=env).start()
        try:
            yield Server(process, ADMIN_KEY, "sqlite-hung-s3"), proxy
        finally:
            proxy.resume()
            process.stop()


def test_hung_object_store_freezes_nothing_else(
    hung_store_server: tuple[Server, HangingProxy], tmp_path: Path
) -> None:
    server, proxy = hung_store_server
    _, key = server.tenant("hang")
    files = files_of(peft_adapter(tmp_path / "a"))
    assert upload(server, key, "before", files).status_code == 201
    base = server.base_url
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    proxy.hang()
    results: list[tuple[float, int, str]] = []
    uploader = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=100))  # shared: cheap calls

    def one_upload(i: int) -> None:
        start = time.monotonic()
        try:
            r = uploader.post(
                f"{base}/v1/adapters",
                headers=bearer(key),
                data={"name": f"hung-{i}"},
                files=[("files", (n, c, "application/octet-stream")) for n, c in files.items()],
            )
            status, code = r.status_code, r.json()["error"]["code"]
        except httpx.HTTPError as exc:
            status, code = 0, type(exc).__name__
        results.append((time.monotonic() - start, status, code))

    # More uploads than anyio's 40-thread pool, the pool they once exhausted.
    with uploader, ThreadPoolExecutor(45) as uploads:
        futures = [uploads.submit(one_upload, i) for i in range(45)]
        time.sleep(0.5)
        timings: dict[str, list[float]] = {"health": [], "metrics": [], "ready": [], "chat": []}
        with httpx.Client(timeout=30) as client:
            for _ in range(3):
                for name, call in (
                    ("health", lambda: client.get(f"{base}/health")),
                    ("metrics", lambda: client.get(f"{base}/metrics")),
                    ("ready", lambda: client.get(f"{base}/ready")),
                    (
                        "chat",
                        lambda: client.post(f"{base}/v1/chat/completions", headers=bearer(key), json=chat),
                    ),
                ):
                    seconds, r = timed(call)
                    timings[name].append(seconds)
                    assert r.status_code == 200, (name, r.text)
                    if name == "ready":
                        body = r.json()
                        assert body["status"] == "degraded" and not body["checks"]["object_store"]["ok"], body
                        assert body["checks"]["database"]["ok"]
        for future in futures:
            future.result()

    print(
        "hung store: "
        + ", ".join(f"{name} max {max(seconds):.2f} s" for name, seconds in timings.items())
        + f"; 429s max {max(r[0] for r in results if r[1] == 429):.2f} s; hung uploads "
        + ", ".join(
            f"{status} {code} after {seconds:.1f} s" for seconds, status, code in results if status != 429
        )
    )
    for name, seconds in timings.items():
        limit = 2.5 if name == "ready" else 1.5  # /ready waits up to ready_timeout_s (1 s) per probe
        assert max(seconds) < limit, (name, seconds)
    refused = [r for r in results if r[1] == 429]
    hung = [r for r in results if r[1] != 429]
    assert len(refused) == 43 and all(r[2] == "too_many_uploads" for r in refused)
    assert max(r[0] for r in refused) < 5.0, refused
    assert len(hung) == 2, hung
    for seconds, status, code in hung:  # the store's own timeouts (503) or the upload's (504)
        assert (status, code) in ((503, "store_unavailable"), (504, "upload_timeout")), hung
        assert seconds < HUNG_UPLOAD_TIMEOUT_S + 3, hung

    proxy.resume()  # recovery: the next upload goes through
    deadline = time.monotonic() + 20
    while (r := upload(server, key, "after", files)).status_code != 201:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert httpx.get(f"{base}/ready", timeout=10).json()["status"] == "ready"


# ---- 3. one tenant flooding admission -----------------------------------------------------------


@pytest.fixture
def small_server(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Server]:
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny-llama", "--max-model-len", "256"]
    args += ["--num-kv-blocks", "256", "--max-num-seqs", "4", "--max-queue-len", "12"]
    with launch_server(args, tmp_path / "data", check_exit=False) as started:
        yield started


def test_flooding_tenant_cannot_lock_out_another(small_server: Server) -> None:
    server = small_server  # 4 running + 12 waiting = 16 slots; reserve 16 // 8 = 2
    base = server.base_url
    _, key_a = server.tenant("flood")
    _, key_b = server.tenant("victim")
    body_a = {"model": "tiny-llama", "prompt": "flood", "max_tokens": 64, "ignore_eos": True}
    body_b = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8}
    stop = threading.Event()
    a_counts = {"ok": 0, "503": 0}

    def flood() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                r = client.post(f"{base}/v1/completions", headers=bearer(key_a), json=body_a)
                outcome = "ok" if r.status_code == 200 else str(r.status_code)
                a_counts[outcome] = a_counts.get(outcome, 0) + 1
                if r.status_code != 200:
                    time.sleep(0.2)  # ignores Retry-After (1 s); faster still is rate limiting's job

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(40)]  # more than the 16 slots
    for thread in flooders:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while server.engine_stats()["num_in_flight"] < 14:
            assert time.monotonic() < deadline, server.engine_stats()
            time.sleep(0.1)
        b_latencies, b_statuses = [], []
        with httpx.Client(timeout=60) as client:
            for _ in range(6):
                seconds, r = timed(
                    lambda: client.post(f"{base}/v1/completions", headers=bearer(key_b), json=body_b)
                )
                b_latencies.append(seconds)
                b_statuses.append(r.status_code)
        in_flight = server.engine_stats()["num_in_flight"]
    finally:
        stop.set()
        for thread in flooders:
            thread.join(130)
    print(
        f"flood: A {a_counts}; B statuses {b_statuses}, latencies "
        + ", ".join(f"{x:.2f}" for x in b_latencies)
    )
    assert a_counts["503"] > 0, a_counts  # A really asked for more than the server admits
    assert b_statuses == [200] * 6, (b_statuses, a_counts)
    assert max(b_latencies) < 20.0, b_latencies  # one of A's running requests ends, then B's starts
    assert in_flight <= 16
