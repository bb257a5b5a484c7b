"""Denial of service: uploads amplifying memory, against a real server process. Three
concurrent uploads of the largest legal adapter must grow the server's RSS by at most 100 MB; the
measurements are printed (`-s` shows them). The other attacks are in test_denial_of_service.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from adapters.limits import max_adapter_weights_bytes
from adapters.types import LORA_MODULES
from tests.harness.peft_adapters import tiny_shapes
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, bearer
from tests.harness.uploads import CONFIG, WEIGHTS

pytestmark = pytest.mark.slow  # real servers

BIG = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4}
BIG |= {"intermediate_size": 1408, "vocab_size": 512}
BIG_MAX_RANK = 160  # largest legal adapter: 8 layers x 7 projections x rank 160 x fp32 = 47.9 MB


def write_full_adapter(
    directory: Path, *, rank: int, seed: int, modules: tuple[str, ...] = LORA_MODULES
) -> Path:
    """A PEFT-format adapter on every layer of the BIG model: the largest legal one at `rank`."""
    shapes, generator = tiny_shapes("llama", **BIG), torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in modules:
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            n_in, n_out = shapes.module_shape(module)
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank}
    (directory / CONFIG).write_text(json.dumps(config | {"target_modules": list(modules)}))
    return directory


def _status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of a process in bytes (/proc/<pid>/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0]) * 1024
    return out


def _post_files(base: str, key: str, name: str, directory: Path) -> httpx.Response:
    with open(directory / CONFIG, "rb") as config, open(directory / WEIGHTS, "rb") as weights:
        return httpx.post(
            f"{base}/v1/adapters",
            headers=bearer(key),
            data={"name": name},
            files=[("files", (CONFIG, config)), ("files", (WEIGHTS, weights))],
            timeout=300,
        )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status")
def test_three_concurrent_maximum_uploads_grow_rss_at_most_100_mb(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = make_checkpoint(arch="llama", **BIG)
    limit = max_adapter_weights_bytes(tiny_shapes("llama", **BIG), BIG_MAX_RANK)
    adapters = [write_full_adapter(tmp_path / f"max{i}", rank=BIG_MAX_RANK, seed=i) for i in range(3)]
    size = (adapters[0] / WEIGHTS).stat().st_size
    assert 3 * size > 140e6 and size <= limit  # three at once could add 144 MB: the bound means something
    small = write_full_adapter(tmp_path / "warm", rank=4, seed=9, modules=("q_proj",))
    too_big = write_full_adapter(tmp_path / "over", rank=200, seed=7)
    args = ["--model", str(model_dir), "--max-model-len", "256", "--num-kv-blocks", "64"]
    args += ["--max-lora-rank", str(BIG_MAX_RANK), "--max-num-seqs", "4"]
    # One tenant runs all three at once: its per-tenant upload slots (2 by default) raised to 3.
    env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY, "LORASERVE_MAX_CONCURRENT_UPLOADS_PER_TENANT": "3"}
    process = ServerProcess(args, tmp_path / "data", env=env).start()
    try:
        server = Server(process, ADMIN_KEY, "sqlite-local")
        _, key = server.tenant("mem")
        base, pid = server.base_url, process.proc.pid  # type: ignore[union-attr]
        assert _post_files(base, key, "warm-up", small).status_code == 201
        over = _post_files(base, key, "over", too_big)
        assert over.status_code == 413, over.text  # rank 200 > 160: the derived limit refuses the body
        time.sleep(1.0)
        before = _status(pid)
        peak = dict(before)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                for name, value in _status(pid).items():
                    peak[name] = max(peak[name], value)
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            responses = list(pool.map(lambda i: _post_files(base, key, f"max-{i}", adapters[i]), range(3)))
        seconds = time.monotonic() - start
        time.sleep(1.0)
        stop.set()
        sampler.join()
        after = _status(pid)
    finally:
        process.stop()
    for r in responses:
        assert r.status_code == 201, r.text
        assert r.json()["size"] == size and r.json()["rank"] == BIG_MAX_RANK
    mb = 1e6
    growth = (after["VmRSS"] - before["VmRSS"]) / mb
    report = (
        f"3 concurrent uploads of {size / mb:.1f} MB (limit {limit / mb:.1f} MB) in {seconds:.1f} s: "
        f"VmRSS {before['VmRSS'] / mb:.0f} -> peak {peak['VmRSS'] / mb:.0f} -> "
        f"after {after['VmRSS'] / mb:.0f} MB "
        f"(growth after {growth:+.1f} MB); RssAnon {before['RssAnon'] / mb:.0f} -> peak "
        f"{peak['RssAnon'] / mb:.0f} -> after {after['RssAnon'] / mb:.0f} MB"
    )
    print(report)
    assert growth <= 100, report
    assert (peak["RssAnon"] - before["RssAnon"]) / mb <= 100, report  # not even transiently copied
