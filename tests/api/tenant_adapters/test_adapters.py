"""Adapter REST API: upload (multipart, validated before storing), list, inspect, version, delete, serve.

Oracles: sha256 of the uploaded bytes, peft's own saved adapters, the store's object listing (nothing
stored after a refusal), and greedy decoding (an adapter changes the base model's output).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.harness.peft_adapters import edit_tensors
from tests.harness.servers import MAX_LORA_RANK, MAX_UPLOAD_BYTES, Server, bearer
from tests.harness.uploads import CONFIG, WEIGHTS, files_of, peft_adapter, peft_adapter_on, upload

pytestmark = pytest.mark.slow  # real servers


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return peft_adapter(tmp_path_factory.mktemp("good") / "a")


@pytest.fixture(scope="module")
def key(server: Server) -> str:
    return server.tenant("ad")[1]


def _other_weights(weights: bytes) -> bytes:
    """The same tensors with one value changed (still a valid adapter, other bytes)."""
    from safetensors.torch import load, save

    tensors = load(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    return save(tensors)


def test_upload_returns_the_ready_version(server: Server, key: str, good_dir: Path) -> None:
    files = files_of(good_dir)
    r = upload(server, key, "bot", files)
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["version"], body["status"]) == ("bot", 1, "ready")
    assert body["sha256"] == hashlib.sha256(files[WEIGHTS]).hexdigest()
    assert body["rank"] == 4 and body["modules"] == ["q_proj", "v_proj", "down_proj"]
    assert body["size"] == len(files[WEIGHTS])
    same = upload(server, key, "bot", files)  # byte-identical: the existing version, nothing new
    assert (same.status_code, same.json()["version"]) == (200, 1), same.text
    second = upload(server, key, "bot", {**files, WEIGHTS: _other_weights(files[WEIGHTS])}).json()
    assert second["version"] == 2  # versions are per name and never reused
    listing = httpx.get(f"{server.base_url}/v1/adapters", headers=bearer(key)).json()
    assert listing["object"] == "list"
    assert [(a["name"], [v["version"] for v in a["versions"]]) for a in listing["data"]] == [("bot", [1, 2])]
    detail = httpx.get(f"{server.base_url}/v1/adapters/bot", headers=bearer(key)).json()
    assert detail["latest_version"] == 2 and all(
        v["residency"] in ("gpu", "cpu", "disk", "store") for v in detail["versions"]
    )


def test_adapter_is_served_by_name_and_version(server: Server, good_dir: Path) -> None:
    _, key = server.tenant("serve")
    assert upload(server, key, "helper", files_of(good_dir)).status_code == 201
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)

    def greedy(model: str) -> str:
        return (
            client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
            .choices[0]
            .text
        )

    base, adapted = greedy("tiny-llama"), greedy("helper")
    assert adapted != base  # the adapter is applied, never a silent fall back to the base model
    assert greedy("helper@1") == adapted
    models = [m.id for m in client.models.list().data]
    assert models == ["tiny-llama", "helper"]
    with pytest.raises(openai.NotFoundError):
        greedy("helper@2")
    # Deleting stops serving at once.
    r = httpx.delete(f"{server.base_url}/v1/adapters/helper", headers=bearer(key))
    assert r.status_code == 200 and r.json()["versions"] == [1]
    with pytest.raises(openai.NotFoundError) as info:
        greedy("helper")
    assert info.value.body["code"] == "model_not_found"
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_delete_one_version(server: Server, key: str, good_dir: Path) -> None:
    files = files_of(good_dir)
    for weights in (files[WEIGHTS], _other_weights(files[WEIGHTS])):
        assert upload(server, key, "multi", {**files, WEIGHTS: weights}).status_code == 201
    r = httpx.delete(f"{server.base_url}/v1/adapters/multi", params={"version": 1}, headers=bearer(key))
    assert r.status_code == 200 and r.json()["versions"] == [1]
    versions = httpx.get(f"{server.base_url}/v1/adapters/multi", headers=bearer(key)).json()["versions"]
    assert [v["version"] for v in versions] == [2]


def _nan(tensors: dict) -> dict:
    name = sorted(tensors)[0]
    tensors[name][0, 0] = math.nan
    return tensors


def _refusals(tmp: Path, good: Path) -> Iterator[tuple[str, str, dict[str, bytes], int, str]]:
    """(case, adapter name, files, status, text the error must contain)."""
    files = files_of(good)
    pickle = {CONFIG: files[CONFIG], "adapter_model.bin": b"\x80\x04pickle"}
    yield "pickle", "p", pickle, 400, "never read; convert them locally with `loraserve adapter convert DIR`"
    wrong = files_of(peft_adapter_on(tmp / "wide", hidden_size=96))
    yield "hidden size", "h", wrong, 400, "shape"
    big_rank = files_of(peft_adapter(tmp / "rank", r=MAX_LORA_RANK * 2, target_modules=["q_proj"]))
    yield "rank", "r", big_rank, 400, "rank"
    nan_dir = Path(shutil.copytree(good, tmp / "nan"))
    edit_tensors(nan_dir, _nan)
    yield "nan", "n", files_of(nan_dir), 400, "finite"
    dora = peft_adapter(tmp / "dora", use_dora=True)
    magnitude = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    for case, edit, needle in (
        ("dora inf magnitude",
         lambda t: {**t, magnitude: t[magnitude].index_fill(0, torch.tensor([3]), math.inf)},
         f"{magnitude} has non-finite values (expected shape (64,))"),
        ("dora short magnitude", lambda t: {**t, magnitude: t[magnitude][:63].clone()},
         f"{magnitude} has shape (63,), expected (64,)"),
    ):  # fmt: skip
        bad = Path(shutil.copytree(dora, tmp / case.replace(" ", "_")))
        edit_tensors(bad, edit)
        yield case, "d", files_of(bad), 400, needle
    untrained = {**files, WEIGHTS: _scaled_b(files[WEIGHTS], 0.0)}
    yield "untrained", "u", untrained, 400, "the adapter changes nothing"
    yield "missing config", "c", {WEIGHTS: files[WEIGHTS]}, 400, CONFIG
    truncated = {CONFIG: files[CONFIG], WEIGHTS: files[WEIGHTS][: len(files[WEIGHTS]) // 2]}
    yield "truncated", "t", truncated, 400, "safetensors"
    yield "path name", "../evil", files, 400, "name"
    yield "slash name", "a/b", files, 400, "name"
    oversize = {CONFIG: files[CONFIG], WEIGHTS: b"\0" * (MAX_UPLOAD_BYTES + 1)}
    yield "oversize", "o", oversize, 413, "limit"


def test_refused_uploads_store_nothing(
    server: Server, key: str, good_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    before = server.store_keys()
    tmp = tmp_path_factory.mktemp("refused")
    for case, name, files, status, needle in _refusals(tmp, good_dir):
        r = upload(server, key, name, files)
        assert r.status_code == status, (case, r.text)
        error = r.json()["error"]
        assert needle.lower() in error["message"].lower(), (case, error)
        assert httpx.get(f"{server.base_url}/v1/adapters/{name}", headers=bearer(key)).status_code == 404, (
            case
        )
    assert server.store_keys() == before
    listing = httpx.get(f"{server.base_url}/v1/adapters", headers=bearer(key)).json()["data"]
    assert not {a["name"] for a in listing} & {"p", "h", "r", "n", "d", "c", "t", "o"}


def test_upload_reports_coverage(server: Server, key: str, good_dir: Path, tiny_llama_dir: Path) -> None:
    from safetensors.torch import load_file

    r = upload(server, key, "cov", files_of(good_dir))
    assert r.status_code == 201, r.text
    coverage = r.json()["coverage"]
    assert (
        coverage["kinds"] == ["lora"]
        and coverage["warning"] is None
        and list(coverage["layers"]) == ["0", "1"]
    )
    base = load_file(str(next(tiny_llama_dir.glob("*.safetensors"))))
    factors = load_file(str(good_dir / WEIGHTS))
    for layer, modules in coverage["layers"].items():
        assert list(modules) == ["q_proj", "v_proj", "down_proj"]
        for module, entry in modules.items():
            name = f"model.layers.{layer}.{'mlp' if module == 'down_proj' else 'self_attn'}.{module}"
            a, b = (factors[f"base_model.model.{name}.lora_{w}.weight"].double() for w in "AB")
            fro = float(torch.linalg.norm(2.0 * b @ a))  # scale = lora_alpha / r = 8 / 4
            assert (entry["kind"], entry["rank"], entry["scale"]) == ("lora", 4, 2.0)
            assert entry["delta_fro"] == pytest.approx(fro, rel=1e-6)
            relative = fro / float(torch.linalg.norm(base[f"{name}.weight"].double()))
            assert entry["relative_delta"] == pytest.approx(relative, rel=1e-6)
    detail = httpx.get(f"{server.base_url}/v1/adapters/cov", headers=bearer(key)).json()
    assert detail["versions"][-1]["coverage"] == coverage
    tiny = {**files_of(good_dir), WEIGHTS: _scaled_b(files_of(good_dir)[WEIGHTS], 1e-8)}
    r = upload(server, key, "cov", tiny)
    assert r.status_code == 201 and r.json()["coverage"]["warning"].startswith("negligible change")


def _scaled_b(weights: bytes, factor: float) -> bytes:
    from safetensors.torch import load, save

    return save({k: v * factor if "lora_B" in k else v for k, v in load(weights).items()})


def test_dora_upload_is_served(server: Server, tmp_path: Path) -> None:
    _, key = server.tenant("dora")
    dora = peft_adapter(tmp_path / "dora", use_dora=True, target_modules=["q_proj", "v_proj", "gate_proj"])
    edit_tensors(dora, lambda t: {k: v * (3.0 if "magnitude" in k else 4.0) for k, v in t.items()})
    assert upload(server, key, "dora", files_of(dora)).status_code == 201
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)

    def greedy(model: str) -> list[float]:
        choice = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=1
        ).choices[0]
        return choice.logprobs.token_logprobs

    assert greedy("dora") != greedy("tiny-llama")  # applied, never the base model


def test_oversize_body_without_content_length_is_cut_off(server: Server, key: str) -> None:
    boundary = "xyzzy"

    def body() -> Iterator[bytes]:
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nchunked\r\n'.encode()
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{WEIGHTS}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        for _ in range(MAX_UPLOAD_BYTES // 4096 + 2):
            yield b"\0" * 4096
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {**bearer(key), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    r = httpx.post(f"{server.base_url}/v1/adapters", headers=headers, content=body(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_bad_form_parts_are_named(server: Server, key: str, good_dir: Path) -> None:
    files = files_of(good_dir)
    r = upload(server, key, "x", {**files, "notes.txt": b"hello"})
    assert r.status_code == 400 and "notes.txt" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.base_url}/v1/adapters", headers=bearer(key), files=[("files", (CONFIG, files[CONFIG]))]
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    r = httpx.post(f"{server.base_url}/v1/adapters", headers=bearer(key), json={"name": "x"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    assert json.loads(files[CONFIG])["peft_type"] == "LORA"  # the good files themselves were fine
