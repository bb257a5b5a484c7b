"""Streaming `multipart/form-data` adapter uploads, bounded while the body is read.

Form: a text field `name` and the two PEFT files as repeated `files` parts whose file names are
exactly `adapter_config.json` and `adapter_model.safetensors`. Parts are written straight to a
temporary directory under those fixed names, chunk by chunk as they arrive (a client's file name
never becomes a path, and no part is ever held in memory whole); the body is refused with 413 as
soon as it passes the size limit (or at once from Content-Length), and anything else, such as
PEFT's pickle `adapter_model.bin`, with 400 naming the part.

The limits come from the base model (`upload_limits`): the weights file may be as large as the
largest legal adapter (adapters/limits.py: seven projections, every layer, `max_lora_rank`, fp32),
the body that plus the largest config and the multipart framing, unless `max_upload_bytes` is set.
The body has a deadline scaled to its size (`UploadLimits.body_deadline_s`): `request_body_timeout_s`
plus its Content-Length (else the body limit) at `upload_min_bytes_per_s`; a body still arriving then
is 408 `request_timeout`, so a client trickling bytes holds its upload slot only that long.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from adapters.files import PICKLE_ADVICE
from adapters.limits import max_adapter_weights_bytes, max_replacement_file_bytes
from adapters.types import BaseModelShapes
from api.errors import APIError
from api.settings import Settings
from registry.types import CONFIG_FILE, WEIGHTS_FILE

NAME_FIELD = "name"
FILES_FIELD = "files"
_MAX_NAME_BYTES = 256
_ALLOWED = (CONFIG_FILE, WEIGHTS_FILE)
# Written by PEFT's save_pretrained beside the adapter: accepted and dropped (not stored), as the CLI does.
_IGNORED = ("README.md",)
MAX_CONFIG_BYTES = 1 << 20  # what adapters/files.py reads of adapter_config.json at most
_FORM_OVERHEAD_BYTES = 64 << 10  # boundaries, part headers and the `name` field
_WRITE_BATCH_BYTES = 1 << 20  # body handed to the parser (and the disk) at a time


@dataclass(frozen=True, slots=True)
class UploadLimits:
    body_bytes: int  # the whole multipart body (413 past it)
    weights_bytes: int  # adapter_model.safetensors (validation refuses a larger file)
    body_grace_s: float = 60.0  # `request_body_timeout_s`: any body may take this long ...
    min_bytes_per_s: int = 256 << 10  # ... plus its size at this rate (`upload_min_bytes_per_s`)

    def body_deadline_s(self, declared_bytes: int | None) -> float:
        """Seconds the body may take: 10 MiB declared at 256 KiB/s, 60 s grace -> 100 s."""
        size = self.body_bytes if declared_bytes is None else min(declared_bytes, self.body_bytes)
        return self.body_grace_s + size / self.min_bytes_per_s


def upload_limits(settings: Settings, base: BaseModelShapes) -> UploadLimits:
    """The body and weights limits for this base model and `max_lora_rank` (see the module docstring)."""
    weights = max_adapter_weights_bytes(base, settings.max_lora_rank)
    weights += max_replacement_file_bytes(base, settings.max_replacement_bytes)
    body = settings.max_upload_bytes or weights + MAX_CONFIG_BYTES + _FORM_OVERHEAD_BYTES
    return UploadLimits(
        body_bytes=body,
        weights_bytes=min(weights, body),
        body_grace_s=settings.request_body_timeout_s,
        min_bytes_per_s=settings.upload_min_bytes_per_s,
    )


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"upload body exceeds the limit of {max_bytes} bytes", code="payload_too_large")


def _too_slow(deadline_s: float) -> APIError:
    return APIError(408, f"the upload body did not arrive within {deadline_s:.0f} s", code="request_timeout")


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_upload")


class _AdapterForm:
    """Multipart callbacks writing the parts of one upload into `dest`."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.name: bytes | None = None
        self.files: set[str] = set()
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._target: IO[bytes] | None = None  # file being written
        self._text: bytearray | None = None  # text field being read

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self._append("_header_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._append("_header_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _append(self, attr: str, data: bytes) -> None:
        setattr(self, attr, getattr(self, attr) + data)

    def _part_begin(self) -> None:
        self._headers = {}

    def _header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        field = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        if field == NAME_FIELD and filename is None:
            self._text = bytearray()
            return
        if field != FILES_FIELD or filename is None:
            raise _bad(
                f"unexpected form part {field!r}; expected a text field '{NAME_FIELD}' and files "
                f"'{FILES_FIELD}' named {_ALLOWED}",
                param=field or None,
            )
        fname = filename.decode("utf-8", "replace")
        if fname.endswith(".bin"):
            raise _bad(f"file {fname!r} refused: {PICKLE_ADVICE}", param=FILES_FIELD)
        if fname in _IGNORED:
            return  # its data is read (and counted against the body limit) but written nowhere
        if fname not in _ALLOWED:
            raise _bad(f"unexpected file {fname!r}; expected exactly {_ALLOWED}", param=FILES_FIELD)
        if fname in self.files:
            raise _bad(f"file {fname!r} appears twice", param=FILES_FIELD)
        self.files.add(fname)
        self._target = open(self.dest / fname, "wb")  # noqa: SIM115 - closed in _part_end / close()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._target is not None:
            self._target.write(data[start:end])
        elif self._text is not None:
            self._text += data[start:end]
            if len(self._text) > _MAX_NAME_BYTES:
                raise _bad(f"field '{NAME_FIELD}' is longer than {_MAX_NAME_BYTES} bytes", param=NAME_FIELD)

    def _part_end(self) -> None:
        if self._target is not None:
            self._target.close()
            self._target = None
        elif self._text is not None:
            if self.name is not None:
                raise _bad(f"field '{NAME_FIELD}' appears twice", param=NAME_FIELD)
            self.name = bytes(self._text)
            self._text = None

    def close(self) -> None:
        if self._target is not None:
            self._target.close()


async def receive_adapter_upload(
    request: Request, dest: Path, *, limits: UploadLimits, executor: Executor | None = None
) -> str:
    """Write the upload's files into `dest`; returns the adapter name from the `name` field.

    413 past `limits.body_bytes`, 408 past `limits.body_deadline_s`. With an `executor`, parsing and
    the file writes run there, `_WRITE_BATCH_BYTES` of body at a time, so a slow disk never blocks the
    event loop."""
    max_bytes = limits.body_bytes
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise _bad(f"expected a multipart/form-data body, got content-type {content_type.decode()!r}")
    declared = request.headers.get("content-length")
    declared_bytes = int(declared) if declared is not None and declared.isdigit() else None
    if declared_bytes is not None and declared_bytes > max_bytes:
        raise _too_large(max_bytes)
    deadline_s = limits.body_deadline_s(declared_bytes)
    form = _AdapterForm(dest)
    parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
    received = 0
    pending = bytearray()
    loop = asyncio.get_running_loop()

    async def write(data: bytes) -> None:
        if executor is None:
            parser.write(data)
        else:
            await loop.run_in_executor(executor, parser.write, data)

    deadline = loop.time() + deadline_s
    chunks = request.stream().__aiter__()
    try:
        while True:
            try:  # only the wait for the client's bytes is timed, never a write in the executor
                chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise _too_slow(deadline_s) from None
            received += len(chunk)
            if received > max_bytes:
                raise _too_large(max_bytes)
            pending += chunk
            if len(pending) >= _WRITE_BATCH_BYTES:
                await write(bytes(pending))
                pending.clear()
        await write(bytes(pending))
        parser.finalize()
    except MultipartParseError as exc:
        raise _bad(f"malformed multipart body: {exc}") from None
    finally:
        form.close()
    if form.name is None:
        raise _bad(f"missing form field '{NAME_FIELD}'", param=NAME_FIELD)
    try:
        return form.name.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise _bad(f"field '{NAME_FIELD}' is not UTF-8", param=NAME_FIELD) from None
