"""Hostile numbers in adapters: subnormal factors beside a victim (its decode rate beside them against
beside clean adapters), and adapters that overflow (refused at upload when their composition can;
on a base whose activations exceed the upload bound's assumption, a named 400 for their own requests
and nothing for anyone else's)."""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file, save_file

from adapters.testing import save_random_adapter
from base_engine.model.config import load_model_config
from reliability.common import BASE, SERVER_ENV, auth
from tests.harness.peft_adapters import edit_config, edit_tensors
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, main_server_args
from tests.harness.uploads import files_of, peft_adapter, upload

ROUNDS = 5
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _filled(directory: Path, seed: int, fill: Callable[[str, torch.Tensor], torch.Tensor]) -> Path:
    adapter = peft_adapter(directory, seed=seed, r=8, lora_alpha=8, target_modules=ALL_LINEAR)
    edit_tensors(adapter, lambda ts: {k: fill(k, v).contiguous() for k, v in ts.items()})
    return adapter


def _victim_ms_per_token(server: Server, key: str, n: int = 64) -> float:
    """A base-model stream's mean gap between tokens after the first (its decode rate)."""
    body = {"model": BASE, "prompt": "victim", "max_tokens": n, "ignore_eos": True, "stream": True}
    stamps = []
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=auth(key), timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def _neighbours(server: Server, key: str, models: list[str], stop: threading.Event, codes: list[int]) -> None:
    """Streams of `models`, one after another per model, until `stop`: the victim is never alone."""

    def run(model: str) -> None:
        body = {"model": model, "prompt": "neighbour", "max_tokens": 240, "ignore_eos": True}
        while not stop.is_set():
            codes.append(
                httpx.post(
                    f"{server.base_url}/v1/completions", json=body, headers=auth(key), timeout=300
                ).status_code
            )

    threads = [threading.Thread(target=run, args=(m,)) for m in models for _ in range(2)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join()


def _subnormal_but_one(_: str, v: torch.Tensor) -> torch.Tensor:
    """Every factor subnormal but the first: flushed at upload it still changes the model (an adapter
    that changes nothing is refused, adapters/coverage.py)."""
    out = torch.full_like(v, 1e-40)
    out.view(-1)[0] = v.view(-1)[0]
    return out


def case_subnormal_adapters(server: Server, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    _, key = server.tenant("subnormal")
    _, victim = server.tenant("victim")
    adapters = {
        "clean-a": _filled(tmp / "ca", 1, lambda _, v: v),
        "clean-b": _filled(tmp / "cb", 2, lambda _, v: v),
        "subnormal": _filled(tmp / "sub", 3, _subnormal_but_one),  # stored as zero but one value each
        "tiny-products": _filled(tmp / "tiny", 4, lambda _, v: torch.full_like(v, 1e-20)),  # subnormal deltas
    }
    for name, path in adapters.items():
        r = upload(server, key, name, files_of(path))
        assert r.status_code == 201, r.text
    rates: dict[str, list[float]] = {"clean": [], "subnormal": []}
    codes: dict[str, list[int]] = {"clean": [], "subnormal": []}
    for _ in range(ROUNDS):  # alternated, medians kept: the machine's load drifts
        for kind, models in (
            ("clean", ["clean-a", "clean-b"]),
            ("subnormal", ["subnormal", "tiny-products"]),
        ):
            stop = threading.Event()
            runner = threading.Thread(target=_neighbours, args=(server, key, models, stop, codes[kind]))
            runner.start()
            time.sleep(0.5)  # the neighbours are decoding (240 tokens each: they outlast the victim)
            try:
                rates[kind].append(_victim_ms_per_token(server, victim))
            finally:
                stop.set()
                runner.join()
    alone = statistics.median(_victim_ms_per_token(server, victim) for _ in range(3))
    clean, subnormal = statistics.median(rates["clean"]), statistics.median(rates["subnormal"])
    ratio = subnormal / clean
    return {
        "victim_ms_per_token_alone": round(alone, 2),
        "victim_ms_per_token_clean": round(clean, 2),
        "victim_ms_per_token_subnormal": round(subnormal, 2),
        "ratio": round(ratio, 3),
        "neighbour_requests": {kind: len(c) for kind, c in codes.items()},
        "neighbour_failures": sum(c != 200 for kind in codes for c in codes[kind]),
        "status_5xx": sum(c >= 500 for kind in codes for c in codes[kind]),
        "slower_by_over_10pct": int(ratio > 1.10),
    }, ["neighbour_failures", "status_5xx", "slower_by_over_10pct"]


# ---- overflowing adapters ------------------------------------------------------------------------

NORM_GAIN = 1e12  # the loud base: RMSNorm weights x 1e12, activations far above the upload bound's X


def _gain_adapter(directory: Path, gains: dict[str, float]) -> Path:
    """A = ones, B = v, scale 1: each projection's delta gain (adapters.composition.delta_gain) is
    exactly gains[projection], r * v * in_features."""
    r = 4
    adapter = peft_adapter(directory, r=r, lora_alpha=r, target_modules=list(gains))
    edit_config(adapter, use_rslora=False, alpha_pattern={}, rank_pattern={})

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, a in tensors.items():
            if "lora_A" in name:
                module = next(m for m in gains if f".{m}." in name)
                b_name = name.replace("lora_A", "lora_B")
                out[name] = torch.ones_like(a)
                out[b_name] = torch.full_like(tensors[b_name], gains[module] / (r * a.shape[1]))
        return out

    edit_tensors(adapter, edit)
    return adapter


def _loud_model(model: Path, directory: Path) -> Path:
    loud = Path(shutil.copytree(model, directory))
    weights = loud / "model.safetensors"
    tensors = load_file(str(weights))
    for name in tensors:
        if name.endswith("input_layernorm.weight"):
            tensors[name] = tensors[name] * NORM_GAIN
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return loud


def _error_code(r: httpx.Response, stream: bool) -> str | None:
    """The error code a request ended with: the JSON body's, or a stream's error event's."""
    if not stream:
        return r.json()["error"]["code"] if r.status_code >= 400 else None
    for line in r.text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            return json.loads(line[6:])["error"]["code"]
    return None


def _overflow_requests(server: Server, evil: str, victim: str) -> tuple[list[str | None], list[int], int]:
    """8 requests of the overflowing adapter (half streamed) beside 4 base-model victims, at once."""
    codes: list[str | None] = []
    statuses: list[int] = []
    victim_failures = 0

    def one(key: str, model: str, stream: bool) -> None:
        nonlocal victim_failures
        body = {"model": model, "prompt": "overflow", "max_tokens": 8, "ignore_eos": True, "stream": stream}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=auth(key), timeout=300)
        statuses.append(r.status_code)
        if model == BASE:
            victim_failures += int(r.status_code != 200 or _error_code(r, stream) is not None)
        else:
            codes.append(_error_code(r, stream))

    jobs = [(evil, "overflow", i % 2 == 0) for i in range(8)] + [(victim, BASE, i % 2 == 0) for i in range(4)]
    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes, statuses, victim_failures


def case_overflowing_adapters(model: Path, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    args = main_server_args(_loud_model(model, tmp / "loud"))
    process = ServerProcess(args, tmp / "data", env=dict(SERVER_ENV)).start()
    try:
        server = Server(process, ADMIN_KEY, "sqlite-local")
        _, evil = server.tenant("overflow")
        _, victim = server.tenant("victim")
        composed = {  # each projection within its own bound; their composition is not
            "c-logits": _gain_adapter(tmp / "cl", {"q_proj": 2e14, "k_proj": 2e14}),
            "c-mlp": _gain_adapter(tmp / "cm", {"gate_proj": 1e15, "up_proj": 1e15}),
            "c-residual": _gain_adapter(tmp / "cr", {"down_proj": 3e13}),
        }
        refused = [upload(server, evil, name, files_of(path)).status_code for name, path in composed.items()]
        # q/k factors of std 1000: within both upload bounds, inf on this base's 1e12 activations.
        shapes = load_model_config(model).base_shapes()
        loud = save_random_adapter(tmp / "loud-a", shapes, rank=4, modules=["q_proj", "k_proj"], std=1000.0)
        accepted = upload(server, evil, "overflow", files_of(loud)).status_code
        codes, statuses, victim_failures = _overflow_requests(server, evil, victim)
        healthy = httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    finally:
        process.stop()
    return {
        "composed_uploads": len(composed),
        "composed_accepted": sum(c < 400 for c in refused),
        "upload_statuses": sorted(set(refused)),
        "loud_adapter_upload": accepted,
        "overflow_requests": len(codes),
        "named_errors": sum(c == "non_finite_activations" for c in codes),
        "unnamed_errors": sum(c != "non_finite_activations" for c in codes),
        "victim_failures": victim_failures,
        "status_5xx": sum(s >= 500 for s in statuses),
        "healthy_after": healthy,
    }, ["composed_accepted", "unnamed_errors", "victim_failures", "status_5xx"]
