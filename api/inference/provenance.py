"""Provenance on every answer: the `X-Loraserve-Provenance` header and the usage record's field.

What is fixed for the process (build, weights, dtype, device, kernels) is read once at start-up
(`server_provenance`); each request adds its adapter, its seed and whether it ran batch-invariant
(`request_provenance`). The header is an RFC 8941 Dictionary, sent with the response headers, so a
stream carries it before its first byte:

    X-Loraserve-Provenance: engine_version="0.1.0", git_sha="4f0c...", torch_version="2.13.0+cpu",
        base_model="tiny-llama", base_sha256="9a1e...", adapter="support-bot", adapter_version=2,
        adapter_sha256="...", adapter_config_sha256="...", dtype="float32", device="cpu",
        device_name="... (AVX512)", lora_kernel="torch", attention="buckets-sdpa", seed="81726...",
        deterministic=?1

Keys are the fields of `registry.provenance.Provenance`; a field that is None (the adapter keys on
the base model) is left out; the seed is a String (RFC 8941 Integers stop at 15 digits); any character
outside printable ASCII is percent-encoded (UTF-8), and so is "%".
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

from api.checkpoints.hashes import base_model_sha256
from base_engine.identity import EngineIdentity
from base_engine.invariant import INVARIANT_ATTENTION, INVARIANT_LORA_KERNEL
from registry.provenance import UNKNOWN, Provenance
from registry.types import AdapterVersionInfo

logger = logging.getLogger(__name__)

HEADER = "X-Loraserve-Provenance"
PACKAGE = "loraserve"
_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout when run from one
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # printable ASCII stays as it is

# /openapi.json: the 200 of both completion routes (FastAPI `responses=`).
OPENAPI_HEADERS: dict[str, Any] = {
    "X-Request-Id": {
        "description": "The response `id`; the usage record's request id.",
        "schema": {"type": "string"},
    },
    HEADER: {
        "description": "What produced this answer, as an RFC 8941 Dictionary: engine_version, git_sha, "
        "torch_version, base_model, base_sha256, adapter, adapter_version, adapter_sha256, "
        "adapter_config_sha256 (absent on the base model), dtype, device, device_name, lora_kernel, "
        "attention, seed (a String: replay with `seed` and `deterministic: true`), deterministic (?1/?0). "
        "The usage export carries the same fields under `provenance`.",
        "schema": {"type": "string"},
    },
}


def engine_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def git_sha(root: Path = _SOURCE_ROOT) -> str:
    """The commit the server runs from, read once at start-up; never fails start.

    `git rev-parse HEAD` when `root` is itself a checkout's top level (an installed copy inside some
    other repository must not report that repository), "-dirty" appended when tracked files differ;
    else the commit pip recorded for a VCS install (direct_url.json); else "unknown"."""
    try:
        top = _git(root, "rev-parse", "--show-toplevel")
        if top is not None and Path(top).resolve() == root.resolve():
            sha = _git(root, "rev-parse", "HEAD")
            if sha:
                dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
                return f"{sha}-dirty" if dirty else sha
    except OSError:  # no git binary
        pass
    return _pip_vcs_commit() or UNKNOWN


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _pip_vcs_commit() -> str | None:
    try:
        raw = importlib.metadata.distribution(PACKAGE).read_text("direct_url.json")
        commit = json.loads(raw or "{}").get("vcs_info", {}).get("commit_id")
    except (importlib.metadata.PackageNotFoundError, ValueError, AttributeError):
        return None
    return commit if isinstance(commit, str) and commit else None


def server_provenance(
    *, model_dir: Path, base_model: str, identity: EngineIdentity, cache_dir: Path
) -> Provenance:
    """The process-wide fields, with the request's fields at their defaults."""
    return Provenance(
        engine_version=engine_version(),
        git_sha=git_sha(),
        torch_version=identity.torch_version,
        base_model=base_model,
        base_sha256=base_model_sha256(model_dir, cache_dir=cache_dir),
        dtype=identity.dtype,
        device=identity.device,
        device_name=identity.device_name,
        lora_kernel=identity.lora_kernel,
        attention=identity.attention,
    )


def request_provenance(
    server: Provenance, adapter: AdapterVersionInfo | None, *, seed: int, deterministic: bool
) -> Provenance:
    if deterministic:  # its steps run the batch-invariant kernels, whatever the engine's default
        server = dataclasses.replace(server, lora_kernel=INVARIANT_LORA_KERNEL, attention=INVARIANT_ATTENTION)
    if adapter is None:
        return dataclasses.replace(server, seed=seed, deterministic=deterministic)
    return dataclasses.replace(
        server,
        adapter=adapter.name,
        adapter_version=adapter.version,
        adapter_sha256=adapter.sha256,
        adapter_config_sha256=adapter.config_sha256,
        seed=seed,
        deterministic=deterministic,
    )


def header_value(provenance: Provenance) -> str:
    """The RFC 8941 Dictionary of `provenance` (None fields left out)."""
    members = []
    for key, value in provenance.to_dict().items():
        if value is None:
            continue
        if isinstance(value, bool):
            item = "?1" if value else "?0"
        elif isinstance(value, int) and key != "seed":
            item = str(value)
        else:
            text = quote(str(value), safe=_SAFE)
            item = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        members.append(f"{key}={item}")
    return ", ".join(members)


def headers(provenance: Provenance | None) -> dict[str, str]:
    return {} if provenance is None else {HEADER: header_value(provenance)}
