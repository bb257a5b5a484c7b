"""`loraserve serve --model random-demo` (the random-weight demo): the demo, overload, disconnects, drain,
restart.

One demo server runs the module in order (max_num_seqs 2 + a queue of 1 = 3 engine requests admitted
at once); the drain test stops it with SIGTERM, and the last test restarts it on the same data dir.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.harness.servers import LORASERVE, ServerProcess
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow  # real servers

DEMO_ARGS = [
    "--model",
    "random-demo",
    "--max-num-seqs",
    "2",
    "--max-queue-len",
    "1",
    "--num-kv-blocks",
    "512",
    "--drain-timeout-s",
    "2",
]
BASE = "loraserve-demo"
LONG = {"max_tokens": 3000, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(DEMO_ARGS, tmp_path_factory.mktemp("demo") / "data").start()
    try:
        yield process
    finally:
        process.stop()


def _key(demo: ServerProcess, name: str) -> str:
    return (demo.data_dir / name).read_text().strip()


def _client(demo: ServerProcess, **kwargs: Any) -> openai.OpenAI:
    key = _key(demo, "demo-tenant.key")
    return openai.OpenAI(base_url=f"{demo.base_url}/v1", api_key=key, max_retries=0, **kwargs)


def _engine(demo: ServerProcess) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {_key(demo, 'admin.key')}"}
    return httpx.get(f"{demo.base_url}/admin/api/engine", headers=auth).json()


def _idle(demo: ServerProcess) -> bool:
    stats = _engine(demo)
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_kv_blocks_used"] == 0


def _wait_idle(demo: ServerProcess, timeout_s: float) -> None:
    # A 3000-token request takes ~20 s on the demo model even on an idle machine: being idle within
    # `timeout_s` means it was aborted.
    wait_for(lambda: _idle(demo), timeout_s, what=lambda: _engine(demo))


def test_banner_keys_and_printed_curl(demo: ServerProcess) -> None:
    log = demo.log()
    admin_key, demo_key = _key(demo, "admin.key"), _key(demo, "demo-tenant.key")
    assert f"admin key:       {admin_key}" in log and f"demo tenant key: {demo_key}" in log
    assert "RANDOM" in log and "--model" in log
    for name in ("admin.key", "demo-tenant.key", "server-secret"):
        assert (demo.data_dir / name).stat().st_mode & 0o777 == 0o600
    curl = re.search(r"^\s*(curl .*)$", log, re.MULTILINE)
    assert curl is not None
    out = subprocess.run(
        ["bash", "-c", curl.group(1) + " --silent --show-error"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert '"object":"chat.completion"' in out.stdout and '"choices"' in out.stdout


def test_demo_tenant_has_two_adapters(demo: ServerProcess) -> None:
    assert [m.id for m in _client(demo).models.list().data] == [BASE, "demo-all-r4", "demo-qv-r8"]


def test_overload_gives_503_with_retry_after(demo: ServerProcess) -> None:
    client = _client(demo)
    # Each create() returns once the 200 headers arrived, i.e. once the request was admitted (two run,
    # one waits in the engine queue: reading its first chunk would wait for a running one to end).
    streams = [client.completions.create(model=BASE, prompt="hi", stream=True, **LONG) for _ in range(3)]
    try:
        assert _engine(demo)["num_in_flight"] == 3
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=BASE, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "overloaded"
        assert info.value.response.headers["x-request-id"].startswith("cmpl-")
    finally:
        for stream in streams:
            stream.close()
    _wait_idle(demo, 10)
    greedy = client.completions.create(model=BASE, prompt="hi", max_tokens=2, temperature=0)
    assert greedy.choices[0].finish_reason == "length"


def test_disconnect_mid_stream_frees_kv(demo: ServerProcess) -> None:
    client = _client(demo)
    stream = client.chat.completions.create(
        model="demo-qv-r8", messages=[{"role": "user", "content": "Hi"}], stream=True, **LONG
    )
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    assert _engine(demo)["num_kv_blocks_used"] > 0
    stream.close()
    _wait_idle(demo, 8)
    assert httpx.get(f"{demo.base_url}/ready").status_code == 200
    greedy = client.completions.create(model=BASE, prompt="hi", max_tokens=2, temperature=0)
    assert greedy.usage.completion_tokens == 2


def test_disconnect_non_streaming_aborts(demo: ServerProcess) -> None:
    body = json.dumps({"model": BASE, "prompt": "hi", "max_tokens": 3000, "ignore_eos": True})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {_key(demo, 'demo-tenant.key')}\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    sock = socket.create_connection(("127.0.0.1", demo.port))
    sock.sendall(request.encode())
    wait_for(lambda: _engine(demo)["num_running"] == 1, 10)
    sock.close()
    _wait_idle(demo, 8)


def test_sigterm_drains_then_exits_zero(demo: ServerProcess) -> None:
    client = _client(demo)
    stream = client.completions.create(model=BASE, prompt="hi", stream=True, **LONG)
    chunks = iter(stream)
    next(chunks)
    outcome: dict[str, Any] = {}

    def read_rest() -> None:
        try:
            for _ in chunks:
                pass
            outcome["error"] = None
        except openai.APIError as exc:
            outcome["error"] = exc

    reader = threading.Thread(target=read_rest)
    reader.start()
    assert demo.proc is not None
    demo.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=BASE, prompt="hi", max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "shutting_down"
    assert httpx.get(f"{demo.base_url}/ready").status_code == 503
    reader.join(30)
    assert isinstance(outcome.get("error"), openai.APIError)  # aborted after the 2 s grace period
    assert "shutting down" in str(outcome["error"])
    assert demo.proc.wait(60) == 0


def test_restart_keeps_keys_and_applies_env_settings(demo: ServerProcess) -> None:
    assert demo.proc is not None and demo.proc.poll() is not None  # stopped by the drain test
    keys = _key(demo, "admin.key"), _key(demo, "demo-tenant.key")
    env = {"LORASERVE_REQUEST_TIMEOUT_S": "1.5"}
    again = ServerProcess(DEMO_ARGS, demo.data_dir, env=env).start()
    try:
        assert (_key(again, "admin.key"), _key(again, "demo-tenant.key")) == keys
        assert f"demo tenant key: {keys[1]}" in again.log()
        auth = {"Authorization": f"Bearer {keys[1]}"}
        adapters = httpx.get(f"{again.base_url}/v1/adapters", headers=auth).json()["data"]
        assert [(a["name"], a["latest_version"]) for a in adapters] == [("demo-all-r4", 1), ("demo-qv-r8", 1)]
        client = _client(again)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=BASE, prompt="hi", **LONG)
        assert info.value.status_code == 504 and info.value.body["code"] == "request_timeout"
        assert time.monotonic() - start < 10
        _wait_idle(again, 8)
    finally:
        assert again.stop() == 0
    assert os.path.exists(demo.data_dir / "demo-model" / "config.json")


def test_cli_tenant_create_and_adapter_push(demo: ServerProcess, tmp_path: Path) -> None:
    from adapters.testing import save_random_adapter
    from api.demo.tenant import DEMO_CHECKPOINT
    from base_engine.model.config import load_model_config

    assert demo.proc is not None and demo.proc.poll() is not None
    loraserve = [LORASERVE]
    data = ["--data-dir", str(demo.data_dir)]
    out = subprocess.run(
        [*loraserve, "tenant", "create", "cli-tenant", *data], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].startswith("lsk-")
    shapes = load_model_config(demo.data_dir / "demo-model").base_shapes()
    assert shapes.hidden_size == DEMO_CHECKPOINT["hidden_size"]
    adapter = save_random_adapter(tmp_path / "a", shapes, rank=2, modules=("o_proj",), seed=5)

    def push(tenant: str) -> subprocess.CompletedProcess[str]:
        cmd = [*loraserve, "adapter", "push", str(adapter), "--tenant", tenant, "--name", "pushed", *data]
        return subprocess.run(cmd, capture_output=True, text=True)

    out = push("cli-tenant")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pushed@1 ") and "modules=o_proj" in out.stdout
