"""A real `loraserve serve` process on a free 127.0.0.1 port, started once per backend and shared.

`server` (session scope, parametrized): "sqlite-local" = SQLite + LocalStore in the data dir;
"postgres-s3" = a database on the throwaway PostgreSQL cluster + a bucket on moto's S3 server (its
AWS_* variables go to the subprocess only). Both serve the tiny random Llama with a small context
(`MAX_MODEL_LEN`) and small limits. Tests create their own tenants (unique names) through the admin
API, so they do not depend on each other. `ServerProcess` is reusable for servers with other options.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from api.deps import Caller
from api.state import AppState
from registry.keys import key_prefix
from registry.tenants import create_tenant
from tests.api import console_helpers

MAX_MODEL_LEN = 256
MAX_UPLOAD_BYTES = 256 << 10
MAX_LORA_RANK = 16
ADMIN_KEY = "lsa-test-admin-key"
LORASERVE = str(Path(sys.executable).with_name("loraserve"))


def new_caller(state: AppState, name: str) -> Caller:
    """A new tenant as the request path sees its caller (for tests that drive api/ functions directly)."""
    with state.sessions() as session:
        tenant, key = create_tenant(session, name=name)
    return Caller(tenant=tenant, key_prefix=key_prefix(key))


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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()[-4000:]}")

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
        client = _s3_client(self.s3)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.s3["bucket"])
        return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def _s3_client(s3: dict[str, str]) -> Any:
    import boto3

    return boto3.session.Session().client(
        "s3",
        endpoint_url=s3["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3["AWS_SECRET_ACCESS_KEY"],
        region_name=s3["AWS_DEFAULT_REGION"],
    )


def _postgres_database(postgres_url: str) -> str:
    import psycopg

    name = f"api_{uuid.uuid4().hex[:12]}"
    admin_dsn = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return postgres_url.removesuffix("/postgres") + f"/{name}"


def _s3_env(s3_server: str, tmp: Path) -> dict[str, str]:
    env = {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
    }
    bucket = f"api-{uuid.uuid4().hex[:20]}"
    _s3_client(env).create_bucket(Bucket=bucket)
    return {**env, "bucket": bucket}


def main_server_args(model_dir: Path) -> list[str]:
    return [
        "--model", str(model_dir), "--served-model-name", "tiny-llama",
        "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--max-num-seqs", "16",
        "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", str(MAX_LORA_RANK),
        "--max-upload-bytes", str(MAX_UPLOAD_BYTES),
    ]  # fmt: skip


@pytest.fixture(scope="session", params=["sqlite-local", "postgres-s3"])
def server(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp(f"server-{request.param}")
    args = main_server_args(tiny_llama_dir)
    env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY}
    s3 = None
    if request.param == "postgres-s3":
        db_url = _postgres_database(request.getfixturevalue("postgres_url"))
        s3 = _s3_env(request.getfixturevalue("s3_server"), tmp)
        args += ["--db", db_url, "--registry", f"s3://{s3['bucket']}/registry"]
        env |= {k: v for k, v in s3.items() if k.startswith("AWS_")}
    process = ServerProcess(args, tmp / "data", env=env).start()
    try:
        yield Server(process, ADMIN_KEY, request.param, s3)
    finally:
        code = process.stop()
        assert code == 0, f"server exited with {code}:\n{process.log()[-4000:]}"


@pytest.fixture(scope="module")
def app_state(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FastAPI, AppState]]:
    """A console-enabled app in process, one per test module (the console tests' app)."""
    with console_helpers.console_app(tiny_llama_dir, tmp_path_factory.mktemp("console")) as started:
        yield started


@pytest.fixture
def app(app_state: tuple[FastAPI, AppState]) -> FastAPI:
    return app_state[0]
