"""Adapters for the API tests, built with `peft` on the tiny Llama's shapes, a multipart uploader, and a
client that trickles an upload's body (raw sockets: its answer read by hand)."""

from __future__ import annotations

import select
import socket
import time
import warnings
from pathlib import Path

import httpx
import torch

from tests.harness.peft_adapters import save_peft_adapter, tiny_model
from tests.harness.servers import Server

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def peft_adapter(directory: Path, *, seed: int = 0, **lora_kwargs: object) -> Path:
    """A LoRA adapter for the tiny Llama (hidden 64, 2 layers) saved by peft's save_pretrained."""
    lora_kwargs.setdefault("r", 4)
    lora_kwargs.setdefault("lora_alpha", 8)
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj", "down_proj"])
    return save_peft_adapter(directory, "llama", seed=seed, **lora_kwargs)


def peft_adapter_on(directory: Path, *, hidden_size: int, **lora_kwargs: object) -> Path:
    """An adapter trained for another model size (same architecture)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", hidden_size=hidden_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        config = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False, **lora_kwargs)
        get_peft_model(model, config).save_pretrained(str(directory))
    return directory


def files_of(directory: Path) -> dict[str, bytes]:
    """The two PEFT files of a saved adapter (save_pretrained also writes a README.md)."""
    return {
        name: (directory / name).read_bytes() for name in (CONFIG, WEIGHTS) if (directory / name).is_file()
    }


def upload(server: Server, key: str, name: str, files: dict[str, bytes]) -> httpx.Response:
    """POST /v1/adapters as multipart: field `name`, one `files` part per file (with its file name)."""
    parts = [("files", (fname, content, "application/octet-stream")) for fname, content in files.items()]
    return httpx.post(
        f"{server.base_url}/v1/adapters",
        headers={"Authorization": f"Bearer {key}"},
        data={"name": name},
        files=parts,
        timeout=120,
    )


def trickling_upload(
    base_url: str, key: str, declared_bytes: int, *, timeout_s: float = 30.0
) -> socket.socket:
    """An upload (raw socket, reads time out after `timeout_s`) whose headers, declaring
    `declared_bytes`, and first bytes arrive, and then nothing more: a client trickling its body."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    head = (
        "POST /v1/adapters HTTP/1.1\r\n"
        f"Host: {host}\r\n"
        f"Authorization: Bearer {key}\r\n"
        "Content-Type: multipart/form-data; boundary=xyz\r\n"
        f"Content-Length: {declared_bytes}\r\n\r\n"
        '--xyz\r\nContent-Disposition: form-data; name="name"\r\n\r\nslow\r\n--xyz\r\n'
    )
    sock.sendall(head.encode())
    return sock


def answered_within(socks: list[socket.socket], seconds: float) -> list[socket.socket]:
    """The sockets on which an answer arrived within `seconds`."""
    deadline, answered = time.monotonic() + seconds, []
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([s for s in socks if s not in answered], [], [], left)
        answered += readable
    return answered


def response_status(sock: socket.socket) -> int:
    """The status code of the answer on `sock`."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])
