"""The safetensors header of an adapter's weights (huggingface/safetensors: 8-byte little-endian header
length, JSON header, raw little-endian data), checked before any tensor is built: dtypes F32/F16/BF16
only, every tensor's byte range inside the data section; and zero-copy tensors over a memory-mapped
file whose ranges tile the data section exactly."""

from __future__ import annotations

import json
import math
import mmap
from typing import Any

import torch

from adapters.files import WEIGHTS_NAME, json_object
from adapters.types import AdapterFormatError

_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own header limit
_DTYPES: dict[str, tuple[torch.dtype, int]] = {"F32": (torch.float32, 4), "F16": (torch.float16, 2)}
_DTYPES["BF16"] = (torch.bfloat16, 2)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def check_header(data: bytes | mmap.mmap) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype, shape) from a safetensors header, refusing truncated or inconsistent files."""
    if len(data) < 8:
        raise AdapterFormatError(f"{WEIGHTS_NAME} is truncated: {len(data)} bytes, no 8-byte header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise AdapterFormatError(
            f"{WEIGHTS_NAME} is truncated or corrupt: header of {header_len} bytes in a {len(data)}-byte file"
        )
    header = json_object(data[8 : 8 + header_len], f"{WEIGHTS_NAME} header")
    header.pop("__metadata__", None)
    data_len = len(data) - 8 - header_len
    infos: dict[str, tuple[str, list[int]]] = {}
    for name, info in header.items():
        entry = info if isinstance(info, dict) else {}
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (_is_int_list(shape) and _is_int_list(offsets) and len(offsets) == 2):
            raise AdapterFormatError(f"tensor {name!r} has a malformed header entry {info!r}")
        if dtype not in _DTYPES:
            raise AdapterFormatError(
                f"tensor {name!r} has dtype {dtype!r}; expected one of {sorted(_DTYPES)}"
            )
        begin, end = offsets
        if end - begin != math.prod(shape) * _DTYPES[dtype][1] or end > data_len:
            raise AdapterFormatError(
                f"{WEIGHTS_NAME} is truncated or corrupt: tensor {name!r} {shape} {dtype} needs bytes "
                f"[{begin}, {end}) of a {data_len}-byte data section"
            )
        infos[name] = (dtype, shape)
    return infos


def mapped_tensors(data: mmap.mmap) -> dict[str, torch.Tensor]:
    """Tensors viewing a mapped safetensors file already passed by `check_header`: no byte is copied.

    Besides `check_header`'s per-tensor checks, the data offsets must tile the data section exactly,
    without gaps or overlaps, as the safetensors library requires of what it loads.
    """
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    header.pop("__metadata__", None)
    data_start, data_len = 8 + header_len, len(data) - 8 - header_len
    position = 0
    for (begin, end), name in sorted((tuple(e["data_offsets"]), n) for n, e in header.items()):
        if begin != position:
            raise ValueError(f"tensor {name!r} starts at byte {begin} of the data section, not {position}")
        position = end
    if position != data_len:
        raise ValueError(f"the tensors cover {position} bytes of a {data_len}-byte data section")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        dtype, count = _DTYPES[entry["dtype"]][0], math.prod(entry["shape"])
        if count == 0:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype, device="cpu")
        else:
            offset = data_start + entry["data_offsets"][0]
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
            tensors[name] = flat.view(entry["shape"])
    return tensors
