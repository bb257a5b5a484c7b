"""Provenance on every answer, on a real server per backend: the `X-Loraserve-Provenance`
header on completions, chat and streamed chat, base model and adapter; the same fields in the usage
record; `deterministic` validation; a server-drawn seed that replays the answer; `--deterministic`.

The header is parsed here with an RFC 8941 Dictionary reader of this file's own, and the base
model's hash is recomputed from the checkpoint's files, so neither side checks itself.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from base_engine.invariant import INVARIANT_LORA_KERNEL
from base_engine.runner.device import auto_cpu_dtype
from base_engine.runner.host import read_cpu_flags
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, bearer, main_server_args
from tests.harness.structured_fields import parse_dictionary
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.usage import export
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow  # real servers

BASE = "tiny-llama"
HEADER = "x-loraserve-provenance"
REPO = Path(__file__).resolve().parents[3]
BUILD_KEYS = {
    "engine_version", "git_sha", "torch_version", "base_model", "base_sha256", "dtype", "device",
    "device_name", "lora_kernel", "attention", "seed", "deterministic",
}  # fmt: skip
SQLITE_ONLY = pytest.mark.parametrize("server", ["sqlite-local"], indirect=True)
ADAPTER_KEYS = {"adapter", "adapter_version", "adapter_sha256", "adapter_config_sha256"}


def checkpoint_sha256(model_dir: Path) -> str:
    """The documented rule: sha256 of the `sha256sum` listing of the safetensors files, sorted by name."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors")
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def _post(server: Server, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{path}", json=body, headers=bearer(key), timeout=120)


def _provenance(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return parse_dictionary(r.headers[HEADER])


def _check_build(p: dict[str, Any], tiny_llama_dir: Path) -> None:
    assert p["engine_version"] == importlib.metadata.version("loraserve")
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", p["git_sha"]), p["git_sha"]
    known = subprocess.run(["git", "cat-file", "-e", p["git_sha"][:40]], cwd=REPO, check=False)
    assert known.returncode == 0, f"{p['git_sha']} is not a commit of this checkout"
    assert p["base_model"] == BASE
    assert p["base_sha256"] == checkpoint_sha256(tiny_llama_dir)
    assert (p["dtype"], p["device"], p["lora_kernel"], p["attention"]) == (
        "float32",
        "cpu",
        "torch",
        "buckets-sdpa",
    )
    assert re.fullmatch(r"\d+", p["seed"]) and int(p["seed"]) < 2**63


def test_header_on_completion_chat_and_stream(server: Server, tiny_llama_dir: Path) -> None:
    _, key = server.tenant("prov")
    completion = _provenance(
        _post(server, key, "completions", {"model": BASE, "prompt": "Hi", "max_tokens": 2})
    )
    assert set(completion) == BUILD_KEYS and completion["deterministic"] is False
    _check_build(completion, tiny_llama_dir)
    chat_body = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 7}
    chat = _provenance(_post(server, key, "chat/completions", chat_body))
    assert chat["seed"] == "7"  # the request's own seed, not a drawn one
    assert {k: v for k, v in chat.items() if k != "seed"} == {
        k: v for k, v in completion.items() if k != "seed"
    }
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={**chat_body, "stream": True},
        headers=bearer(key),
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        streamed = parse_dictionary(r.headers[HEADER])  # with the headers, before any event is read
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert streamed == chat


def test_adapter_provenance_matches_registry_and_usage_record(
    server: Server, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    tenant_id, key = server.tenant("prov-lora")
    files = files_of(peft_adapter(tmp_path / "a", seed=3))
    assert upload(server, key, "prov-bot", files).status_code == 201
    info = httpx.get(f"{server.base_url}/v1/adapters/prov-bot", headers=bearer(key), timeout=30).json()
    version = info["versions"][-1]
    assert version["sha256"] == hashlib.sha256(files["adapter_model.safetensors"]).hexdigest()
    r = _post(server, key, "completions", {"model": "prov-bot", "prompt": "Hello", "max_tokens": 3})
    with_adapter = _provenance(r)
    assert set(with_adapter) == BUILD_KEYS | ADAPTER_KEYS
    _check_build(with_adapter, tiny_llama_dir)
    assert with_adapter["adapter"] == "prov-bot" and with_adapter["adapter_version"] == version["version"]
    assert with_adapter["adapter_sha256"] == version["sha256"]
    assert with_adapter["adapter_config_sha256"] == version["config_sha256"]
    base = _provenance(_post(server, key, "completions", {"model": BASE, "prompt": "Hello", "max_tokens": 3}))

    records: dict[str, dict[str, Any]] = {}

    def billed() -> bool:
        records.update({rec["request_id"]: rec for rec in export(server.base_url, tenant_id)})
        return r.headers["x-request-id"] in records and len(records) >= 2

    wait_for(billed, 30.0, interval=0.1, what="both usage records exported")
    stored = records[r.headers["x-request-id"]]["provenance"]
    assert {k: v for k, v in stored.items() if v is not None} == {
        **with_adapter,
        "seed": int(with_adapter["seed"]),
    }
    base_record = next(rec for rid, rec in records.items() if rid != r.headers["x-request-id"])
    assert base_record["provenance"]["adapter"] is None
    assert base_record["provenance"]["seed"] == int(base["seed"])


@SQLITE_ONLY  # request validation does not depend on the backend
@pytest.mark.parametrize("value", ["yes", 1, "true", None])
def test_deterministic_must_be_a_boolean(server: Server, value: Any) -> None:
    _, key = server.tenant("prov-bad")
    r = _post(
        server, key, "completions", {"model": BASE, "prompt": "Hi", "max_tokens": 1, "deterministic": value}
    )
    if value is None:  # null = not sent
        assert _provenance(r)["deterministic"] is False
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "deterministic", r.text
    assert "deterministic" in r.json()["error"]["message"]


@SQLITE_ONLY  # nor does sampling
def test_drawn_seed_replays_the_sampled_answer(server: Server) -> None:
    _, key = server.tenant("prov-seed")
    body = {"model": BASE, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "logprobs": 1}
    first = _post(server, key, "completions", {**body, "deterministic": True})
    drawn = _provenance(first)
    assert drawn["deterministic"] is True
    # its steps ran the batch-invariant kernels, not the engine's default ones
    assert (drawn["lora_kernel"], drawn["attention"]) == ("torch-bags-invariant", "token-sdpa-invariant")
    others = {
        _provenance(_post(server, key, "completions", {**body, "max_tokens": 1}))["seed"] for _ in range(3)
    }
    assert drawn["seed"] not in others and len(others) == 3  # a fresh 63-bit seed per request
    replay = _post(server, key, "completions", {**body, "deterministic": True, "seed": int(drawn["seed"])})
    assert _provenance(replay) == drawn
    original, again = first.json()["choices"][0]["logprobs"], replay.json()["choices"][0]["logprobs"]
    assert again["tokens"] == original["tokens"] and again["token_logprobs"] == original["token_logprobs"]


def test_server_wide_deterministic_overrules_false(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`--deterministic`: every answer says deterministic=?1, even one that asked for false."""
    env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY}
    process = ServerProcess(
        [*main_server_args(tiny_llama_dir), "--deterministic"], tmp_path / "data", env=env
    )
    process.start()
    try:
        server = Server(process, ADMIN_KEY, "sqlite-local")
        _, key = server.tenant("prov-det")
        for asked in (False, None):
            body = {"model": BASE, "prompt": "Hi", "max_tokens": 1, "deterministic": asked}
            assert _provenance(_post(server, key, "completions", body))["deterministic"] is True
        cached = tmp_path / "data" / "model-hashes.json"
        assert cached.is_file()  # the base hash, kept for the next start
    finally:
        assert process.stop() == 0, process.log()[-4000:]


def test_deterministic_where_the_engine_cannot_keep_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """float16: `--deterministic` does not start, naming the dtypes that can."""
    env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY}
    args = [*main_server_args(tiny_llama_dir), "--dtype", "float16", "--deterministic"]
    refused = ServerProcess(args, tmp_path / "refused", env=env)
    with pytest.raises(RuntimeError, match="deterministic mode needs dtype float32 or bfloat16"):
        refused.start()


def test_dtype_auto_is_reported_and_deterministic_in_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`--dtype auto` serves bfloat16 on a CPU with AMX / AVX512-BF16 (float32 elsewhere): provenance and
    /v1/models say which, and a deterministic request runs that dtype's batch-invariant kernels."""
    expected = str(auto_cpu_dtype(read_cpu_flags())[0]).removeprefix("torch.")
    env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY, "LORASERVE_LOG_LEVEL": "info"}  # the choice is logged at info
    args = [*main_server_args(tiny_llama_dir), "--dtype", "auto"]
    process = ServerProcess(args, tmp_path / "data", env=env)
    process.start()
    try:
        server = Server(process, ADMIN_KEY, "sqlite-local")
        _, key = server.tenant("prov-auto")
        body = {"model": BASE, "prompt": "Hi", "max_tokens": 2}
        assert _provenance(_post(server, key, "completions", body))["dtype"] == expected
        cards = httpx.get(f"{server.base_url}/v1/models", headers=bearer(key), timeout=30).json()["data"]
        assert cards[0]["id"] == BASE and cards[0]["dtype"] == expected
        det = _provenance(_post(server, key, "completions", {**body, "deterministic": True}))
        assert det["deterministic"] is True and det["lora_kernel"] == INVARIANT_LORA_KERNEL
        assert f"dtype auto -> {expected}: the CPU has" in process.log()
    finally:
        assert process.stop() == 0, process.log()[-4000:]
