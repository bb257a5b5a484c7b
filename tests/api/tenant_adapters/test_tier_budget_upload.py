"""Uploads no tier could hold are refused with the figures and store nothing (adapters/host_tier.py):
modules_to_save copies above the host tier's bytes (`LORASERVE_MAX_CPU_LORA_BYTES`), a weights file above
the local disk tier's (`LORASERVE_DISK_CACHE_BYTES`); an adapter within both is accepted. Real server."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.harness.servers import Server, bearer, launch_server, main_server_args
from tests.harness.uploads import WEIGHTS, files_of, peft_adapter, upload

pytestmark = pytest.mark.slow  # a real server

HEAD_COPY = 512 * 64 * 4  # the tiny Llama checkpoint's lm_head [vocab, hidden], served in fp32
DISK_BYTES = 60_000
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"LORASERVE_MAX_CPU_LORA_BYTES": str(HEAD_COPY - 1), "LORASERVE_DISK_CACHE_BYTES": str(DISK_BYTES)}
    data = tmp_path_factory.mktemp("tiers") / "data"
    with launch_server(main_server_args(tiny_llama_dir), data, env=env) as started:
        yield started


def _head_adapter(model_dir: Path, out: Path) -> Path:
    """q_proj LoRA plus a modules_to_save lm_head, on the served checkpoint (its vocabulary)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LoraConfig(
            r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=False
        )
        get_peft_model(base, config).save_pretrained(out)
    return out


def test_uploads_no_tier_could_hold_are_refused_with_the_figures(
    server: Server, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _, key = server.tenant("tiers")
    before = server.store_keys()
    head = files_of(_head_adapter(tiny_llama_dir, tmp_path / "head"))
    wide = files_of(peft_adapter(tmp_path / "wide", r=16, target_modules=ALL))
    assert len(wide[WEIGHTS]) > DISK_BYTES
    cases = [
        ("head", head, f"copies need {HEAD_COPY} bytes of host memory", f"budget of {HEAD_COPY - 1} bytes",
         "LORASERVE_MAX_CPU_LORA_BYTES"),
        ("wide", wide, f"needs {len(wide[WEIGHTS])} bytes on the local disk tier", f"budget of {DISK_BYTES}",
         "LORASERVE_DISK_CACHE_BYTES"),
    ]  # fmt: skip
    for name, files, *needles in cases:
        r = upload(server, key, name, files)
        assert r.status_code == 400, (name, r.text)
        message = r.json()["error"]["message"]
        assert all(n in message for n in needles), (name, message)
        assert httpx.get(f"{server.base_url}/v1/adapters/{name}", headers=bearer(key)).status_code == 404
    assert server.store_keys() == before
    plain = upload(server, key, "plain", files_of(peft_adapter(tmp_path / "plain")))
    assert plain.status_code == 201, plain.text
