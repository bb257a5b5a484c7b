"""`loraserve serve` started with a typical `vllm serve` command line, driven by the official `openai`
client: positional MODEL, `--enable-lora`, `--lora-modules` (both forms), `--api-key` (the static key acts
as the tenant's), `--served-model-name`, `--max-model-len`, `--chat-template`, `-tp 1`; `-tp 2`, an
unknown `--tool-call-parser` and a bad `--lora-modules` are one-line errors, exit 2
(api/cli/vllm_flags.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from adapters.testing import save_random_adapter
from api.cli.vllm_flags import rewrite_vllm_argv
from base_engine.model.config import load_model_config
from tests.harness.families import CHECKPOINTS
from tests.harness.servers import LORASERVE, launch_server

STATIC_KEY = "sk-my-static-key"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the content alone: easy to count


@pytest.fixture(scope="module")
def model_dir(make_checkpoint) -> Path:
    return make_checkpoint(**CHECKPOINTS["llama-gqa"])


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("vllm")
    shapes = load_model_config(model_dir).base_shapes()
    a = save_random_adapter(tmp / "a", shapes, rank=4, modules=("q_proj", "v_proj"), seed=1)
    b = save_random_adapter(tmp / "b", shapes, rank=2, modules=("o_proj",), seed=2)
    (tmp / "template.jinja").write_text(TEMPLATE)
    args = [
        str(model_dir), "--enable-lora",
        "--lora-modules", f"sql={a}", json.dumps({"name": "chat-b", "path": str(b)}),
        "--api-key", STATIC_KEY, "--served-model-name", "m", "--max-model-len", "512",
        "--max-lora-rank", "8", "--chat-template", str(tmp / "template.jinja"), "--tensor-parallel-size", "1",
    ]  # fmt: skip
    with launch_server(args, tmp / "data") as server:
        yield server.base_url


@pytest.mark.slow
def test_a_vllm_command_line_serves_with_the_static_key(vllm_server: str, model_dir: Path) -> None:
    client = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key=STATIC_KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["m", "chat-b", "sql"]
    content = "What is the capital of France?"
    for model in ("m", "sql", "chat-b"):
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0.0
        )
        assert chat.usage.completion_tokens == 4
        # --chat-template: the prompt is the content alone, as the template renders it.
        expected = AutoTokenizer.from_pretrained(model_dir).encode(content, add_special_tokens=False)
        assert chat.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError) as info:  # --max-model-len 512
        client.completions.create(model="m", prompt="hi", max_tokens=600)
    assert "512" in info.value.body["message"]
    wrong = httpx.get(f"{vllm_server}/v1/models", headers={"Authorization": "Bearer sk-not-it"}, timeout=30)
    assert wrong.status_code == 401


@pytest.mark.slow
def test_ping_and_version(vllm_server: str) -> None:
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{vllm_server}/ping", timeout=30)
        assert (ping.status_code, ping.content) == (200, b"")
    version = httpx.get(f"{vllm_server}/version", timeout=30)
    assert version.status_code == 200 and version.json()["version"].startswith("0.")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tensor-parallel-size", "2"], "tensor parallelism is not served"),
        (["-tp=4"], "tensor parallelism is not served"),
        (["--tool-call-parser", "pythonic"], "expected one of ['llama3_json', 'hermes', 'mistral']"),
        (["--lora-modules", "{bad json"], "expected name=path or JSON"),
    ],
)
def test_flags_we_cannot_honour_are_one_line_exit_2(model_dir: Path, tmp_path: Path, flags, says) -> None:
    cmd = [LORASERVE, "serve", str(model_dir), "--data-dir", str(tmp_path / "data"), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], out.stderr


def test_version() -> None:
    out = subprocess.run([LORASERVE, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("loraserve 0.")


def test_argv_rewrite() -> None:
    argv = [
        "serve",
        "--port",
        "5",
        "M",
        "--enable-lora",
        "--lora-modules",
        "a=/x",
        '{"name": "b", "path": "/y"}',
    ]
    assert rewrite_vllm_argv([*argv, "-tp", "1", "--dtype", "float32"]) == [
        "serve", "--port", "5", "--model", "M",
        "--lora-module", "a=/x", "--lora-module", "b=/y", "--dtype", "float32",
    ]  # fmt: skip
    assert rewrite_vllm_argv(["tenant", "create", "x"]) == ["tenant", "create", "x"]
