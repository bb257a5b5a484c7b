"""The hostile uploads case: about forty malformed, oversized, malicious or unauthenticated adapter
uploads; none may be accepted, answer 5xx, or leave a file in the store or on disk."""

from __future__ import annotations

import json
import math
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file, save_file

from reliability.common import BASE, EVIL, auth
from tests.harness.servers import MAX_LORA_RANK, MAX_UPLOAD_BYTES, Server
from tests.harness.uploads import CONFIG, WEIGHTS, files_of, peft_adapter, peft_adapter_on, upload

# ---- 2. hostile uploads --------------------------------------------------------------------------


def _edit(files: dict[str, bytes], fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / WEIGHTS
        path.write_bytes(files[WEIGHTS])
        tensors = fn(load_file(str(path)))
        save_file(tensors, str(path))
        return path.read_bytes()


def _config(files: dict[str, bytes], **changes: Any) -> dict[str, bytes]:
    config = json.loads(files[CONFIG])
    config.update(changes)
    return {**files, CONFIG: json.dumps(config).encode()}


def _header(obj: Any, data: bytes = b"") -> bytes:
    header = json.dumps(obj).encode()
    return len(header).to_bytes(8, "little") + header + data


# PEFT saves a modules_to_save copy under the module's own name.
_HEAD = "base_model.model.lm_head.weight"
_EMBED = "base_model.model.model.embed_tokens.weight"


def _first(ts: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    name = sorted(ts)[0]
    ts[name][0, 0] = value
    return ts


def _magnitude(ts: dict[str, torch.Tensor], value: float | None) -> dict[str, torch.Tensor]:
    """One DoRA magnitude set to `value`, or (None) cut one element short."""
    name = next(k for k in sorted(ts) if k.endswith("lora_magnitude_vector"))
    ts[name] = ts[name][:-1].clone() if value is None else ts[name].index_fill(0, torch.tensor([0]), value)
    return ts


def hostile_uploads(tmp: Path) -> list[tuple[str, str, dict[str, bytes] | None, dict[str, Any] | None]]:
    """(kind, adapter name, multipart files or None, raw httpx kwargs or None)."""
    good = files_of(peft_adapter(tmp / "good"))
    dora = files_of(peft_adapter(tmp / "dora", use_dora=True))
    cfg = json.loads(good[CONFIG])
    nested = b"[" * 100_000 + b"]" * 100_000
    kinds: list[tuple[str, str, dict[str, bytes] | None, dict[str, Any] | None]] = [
        ("pickle weights", "h-pickle", {CONFIG: good[CONFIG], "adapter_model.bin": b"\x80\x04pickle"}, None),
        ("wrong hidden size", "h-hidden", files_of(peft_adapter_on(tmp / "wide", hidden_size=96)), None),
        ("rank above limit", "h-rank",
         files_of(peft_adapter(tmp / "rank", r=MAX_LORA_RANK * 2, target_modules=["q_proj"])), None),
        ("NaN weight", "h-nan", {**good, WEIGHTS: _edit(good, lambda t: _first(t, math.nan))}, None),
        ("Inf weight", "h-inf", {**good, WEIGHTS: _edit(good, lambda t: _first(t, math.inf))}, None),
        ("huge weights (overflow)", "h-huge",
         {**good, WEIGHTS: _edit(good, lambda t: {k: v * 1e37 for k, v in t.items()})}, None),
        ("DoRA NaN magnitude", "h-dora-nan",
         {**dora, WEIGHTS: _edit(dora, lambda t: _magnitude(t, math.nan))}, None),
        ("DoRA short magnitude", "h-dora-len",
         {**dora, WEIGHTS: _edit(dora, lambda t: _magnitude(t, None))}, None),
        ("modules_to_save lm_head of the wrong shape", "h-mts-shape", _config(
            {**good, WEIGHTS: _edit(good, lambda t: {**t, _HEAD: torch.zeros(3, 5)})},
            modules_to_save=["lm_head"]), None),
        ("10 GB embedding replacement (header)", "h-mts-10gb", _config(
            {**good, WEIGHTS: _header({_EMBED: {"dtype": "F32", "shape": [(10 << 30) // 256, 64],
                                                "data_offsets": [0, 10 << 30]}}, b"\0" * 64)},
            modules_to_save=["embed_tokens"]), None),
        ("missing config", "h-nocfg", {WEIGHTS: good[WEIGHTS]}, None),
        ("missing weights", "h-now", {CONFIG: good[CONFIG]}, None),
        ("truncated weights", "h-trunc", {**good, WEIGHTS: good[WEIGHTS][: len(good[WEIGHTS]) // 2]}, None),
        ("empty weights", "h-empty", {**good, WEIGHTS: b""}, None),
        ("header length 2^60", "h-hlen", {**good, WEIGHTS: (1 << 60).to_bytes(8, "little") + b"{}"}, None),
        ("header offsets past the end", "h-offs", {**good, WEIGHTS: _header(
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
             {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1 << 40]}}, b"\0" * 64)}, None),
        ("nested JSON header", "h-nesth",
         {**good, WEIGHTS: len(nested).to_bytes(8, "little") + nested}, None),
        ("nested JSON config", "h-nestc",
         {**good, CONFIG: good[CONFIG][:-1] + b', "runtime_config": ' + nested + b"}"}, None),
        ("config not JSON", "h-cfgjson", {**good, CONFIG: b"{not json"}, None),
        ("config a JSON array", "h-cfgarr", {**good, CONFIG: b"[]"}, None),
        ("NaN lora_alpha", "h-nanalpha",
         {**good, CONFIG: good[CONFIG].replace(f'"lora_alpha": {cfg["lora_alpha"]}'.encode(),
                                              b'"lora_alpha": NaN')}, None),
        ("Infinity lora_alpha", "h-infalpha", _config(good, lora_alpha=1e309), None),
        ("rank 0", "h-r0", _config(good, r=0), None),
        ("rank 2^63", "h-rbig", _config(good, r=2**63), None),
        ("peft_type PREFIX_TUNING", "h-ptype", _config(good, peft_type="PREFIX_TUNING"), None),
        ("regex DoS target_modules", "h-regex", _config(good, target_modules=EVIL), None),
        ("unknown target modules", "h-targets", _config(good, target_modules=["no_such_proj"]), None),
        ("A/B shapes swapped", "h-swap", {**good, WEIGHTS: _edit(
            good, lambda t: {k: v.t().contiguous() for k, v in t.items()})}, None),
        ("integer weights", "h-int",
         {**good, WEIGHTS: _edit(good, lambda t: {k: v.to(torch.int32) for k, v in t.items()})}, None),
        ("oversize body", "h-big", {CONFIG: good[CONFIG], WEIGHTS: b"\0" * (MAX_UPLOAD_BYTES + 1)}, None),
        ("extra file part", "h-extra", {**good, "notes.txt": b"hello"}, None),
        ("path traversal name", "../evil", good, None),
        ("slash in name", "a/b", good, None),
        ("empty name", "", good, None),
        ("name 1000 characters", "n" * 1000, good, None),
        ("base model's name", BASE, good, None),
        ("no name field", "h-noname", None, {"files": [("files", (CONFIG, good[CONFIG]))]}),
        ("JSON body, not multipart", "h-json", None, {"json": {"name": "h-json"}}),
        ("garbage multipart body", "h-garb", None, {
            "content": b"--x\r\nnot a part\r\n",
            "headers": {"Content-Type": "multipart/form-data; boundary=x"}}),
        ("multipart without boundary", "h-nobound", None, {
            "content": b"abc", "headers": {"Content-Type": "multipart/form-data"}}),
        ("no API key", "h-nokey", good, {"noauth": True}),
        ("Basic Authorization", "h-basic", good, {"headers": {"Authorization": "Basic dXNlcjpwYXNz"}}),
        ("forged API key", "h-forged", good, {"headers": {"Authorization": "Bearer lsk-0000-forged"}}),
    ]  # fmt: skip
    return kinds


def _disk_files(data_dir: Path) -> set[str]:
    skip = re.compile(r"loraserve\.db|journal|\.log$|admin\.key|\.secret")
    return {
        str(p.relative_to(data_dir)) for p in data_dir.rglob("*") if p.is_file() and not skip.search(str(p))
    }


def case_hostile_uploads(server: Server, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    _, key = server.tenant("hostile")
    kinds = hostile_uploads(tmp)
    store_before, disk_before = server.store_keys(), _disk_files(server.process.data_dir)
    accepted, statuses, server_errors = [], {}, 0
    url = f"{server.base_url}/v1/adapters"
    for kind, name, files, raw in kinds:
        if raw is None:
            r = upload(server, key, name, files or {})
        else:
            headers = {} if raw.get("noauth") else auth(key)
            headers |= raw.get("headers", {})
            kwargs = {k: v for k, v in raw.items() if k not in ("headers", "noauth")}
            if files is not None:
                kwargs["files"] = [("files", (n, c, "application/octet-stream")) for n, c in files.items()]
                kwargs["data"] = {"name": name}
            r = httpx.post(url, headers=headers, timeout=120, **kwargs)
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        if r.status_code < 400:
            accepted.append(kind)
        if r.status_code >= 500:
            server_errors += 1
            sys.stderr.write(f"hostile upload {kind!r}: {r.status_code} {r.text[:200]}\n")
    listing = httpx.get(url, headers=auth(key), timeout=60).json()["data"]
    leftovers = len(server.store_keys() - store_before) + len(
        _disk_files(server.process.data_dir) - disk_before
    )
    healthy = httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    return {
        "kinds": len(kinds),
        "accepted": len(accepted),
        "accepted_kinds": accepted,
        "statuses": statuses,
        "status_5xx": server_errors,
        "adapters_listed": len(listing),
        "leftovers": leftovers,
        "healthy_after": healthy,
    }, ["accepted", "adapters_listed", "leftovers", "status_5xx"]
