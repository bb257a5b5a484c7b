"""A real `loraserve serve` process on a free 127.0.0.1 port, and the client helpers tests drive it with.

`ServerProcess(args, data_dir, env=...)` is the one launcher (`start()` waits for /ready, `stop()`
returns the exit status); `launch_server(...)` is it as a context manager that yields a `Server` (the
process plus admin, tenant and object-store helpers) and checks the clean exit. `main_server_args`
are the options of the shared API servers (tiny Llama, small context and limits).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.harness.s3 import s3_client
from tests.harness.wait import WaitTimeout, wait_for

MAX_MODEL_LEN = 256
MAX_UPLOAD_BYTES = 256 << 10
MAX_LORA_RANK = 16
ADMIN_KEY = "lsa-test-admin-key"
LORASERVE = str(Path(sys.executable).with_name("loraserve"))


def bearer(key: str) -> dict[str, str]:
    """The Authorization header of an API or admin key."""
    return {"Authorization": f"Bearer {key}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_for_ray() -> int:
    """A free port Ray will not take while it starts: Ray binds its own servers to random ports from
    the kernel's ephemeral range (32768-60999 here) and its workers to 10002-19999, so a port probed
    free in the ephemeral range could be Ray's by the time its HTTP proxy binds it (seen: "Failed to
    bind to address"). This one lies between the two ranges."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


def main_server_args(model_dir: Path) -> list[str]:
    return [
        "--model", str(model_dir), "--served-model-name", "tiny-llama",
        "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--max-num-seqs", "16",
        "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", str(MAX_LORA_RANK),
        "--max-upload-bytes", str(MAX_UPLOAD_BYTES),
    ]  # fmt: skip


@dataclass
class ServerProcess:
    """`loraserve serve <args>` in a subprocess; output goes to `log_path`."""

    args: list[str]
    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"server-{self.port}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout_s: float = 240.0) -> ServerProcess:
        cmd = [LORASERVE, "serve", "--data-dir", str(self.data_dir), "--port", str(self.port), *self.args]
        env = {**os.environ, "LORASERVE_LOG_LEVEL": "warning", **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(self._is_ready, timeout_s, interval=0.25, what="/ready")
        except WaitTimeout:
            self.stop()
            raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()[-4000:]}") from None
        return self

    def _is_ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
        try:
            return httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` and wait for the exit status (killing the process if it hangs)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return int(self.proc.returncode)


@dataclass
class Server:
    """A running server plus helpers; `store_keys()` lists the object store's keys."""

    process: ServerProcess
    admin_key: str
    backend: str
    s3: dict[str, str] | None = None  # AWS_* env and the bucket, for the postgres-s3 backend

    @property
    def base_url(self) -> str:
        return self.process.base_url

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        return httpx.request(
            method, f"{self.base_url}/admin/api{path}", headers=headers, timeout=60, **kwargs
        )

    def tenant(self, prefix: str = "t") -> tuple[str, str]:
        """A new tenant (id, api key) with a unique name."""
        r = self.admin("POST", "/tenants", json={"name": f"{prefix}-{uuid.uuid4().hex[:8]}"})
        assert r.status_code == 201, r.text
        return r.json()["id"], r.json()["api_key"]

    def engine_stats(self) -> dict[str, Any]:
        r = self.admin("GET", "/engine")
        assert r.status_code == 200, r.text
        return r.json()

    def store_keys(self) -> set[str]:
        if self.s3 is None:
            root = self.process.data_dir / "objects"
            return (
                {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()
            )
        client = s3_client(self.s3)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.s3["bucket"])
        return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


@contextmanager
def launch_server(
    args: list[str],
    data_dir: Path,
    *,
    env: dict[str, str] | None = None,
    admin_key: str = ADMIN_KEY,
    backend: str = "sqlite-local",
    s3: dict[str, str] | None = None,
    timeout_s: float = 240.0,
    check_exit: bool = True,
) -> Iterator[Server]:
    """A started server (admin key in its environment) for the `with` block; stopped afterwards, and
    with `check_exit` its exit status must be 0 (a clean drain)."""
    process = ServerProcess(args, data_dir, env={"LORASERVE_ADMIN_KEY": admin_key, **(env or {})})
    process.start(timeout_s)
    try:
        yield Server(process, admin_key, backend, s3)
    finally:
        code = process.stop()
        if check_exit:
            assert code == 0, f"server exited with {code}:\n{process.log()[-4000:]}"
