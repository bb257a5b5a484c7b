"""Reading an adapter directory's two files once, bounded: `adapter_config.json` (at most 1 MiB, a JSON
object nested at most 32 levels) and `adapter_model.safetensors` (size checked against the limit before
it is read, or memory-mapped for upload validation). Pickle (`adapter_model.bin`) is never read."""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.types import AdapterFormatError, AdapterValidationError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
# What a refusal of pickle weights tells the tenant: the safe, local way to get the safetensors file.
PICKLE_ADVICE = (
    f"pickle weights are never read; convert them locally with `loraserve adapter convert DIR` "
    f"(loads {PICKLE_NAME} with torch.load(weights_only=True) and writes {WEIGHTS_NAME}), then upload that"
)
_MAX_CONFIG_BYTES = 1 << 20
# PEFT configs and safetensors headers nest three or four levels; a deeper document is hostile (near
# the interpreter's recursion limit it breaks json.loads, and later repr() and comparisons of it).
_MAX_JSON_DEPTH = 32


@dataclass(frozen=True)
class AdapterFiles:
    """The two files of an adapter directory, read once so hashes and parsing see the same bytes.

    `weights_bytes` is the file's bytes, or with `read_adapter_files(..., mapped=True)` a private
    memory map of it (`mmap.ACCESS_COPY`, never written): hashing and parsing then read the page
    cache and copy nothing; `close()` unmaps it once no tensor views it any more.
    """

    config: dict[str, Any]
    config_bytes: bytes
    weights_bytes: bytes | mmap.mmap

    def close(self) -> None:
        """Unmap mapped weights; if tensors still view them, the map goes when they are collected."""
        if isinstance(self.weights_bytes, mmap.mmap):
            try:
                self.weights_bytes.close()
            except BufferError:
                pass


def read_adapter_files(
    adapter_dir: Path, *, max_size_bytes: int | None = None, mapped: bool = False
) -> AdapterFiles:
    """Read config and weights; the weights' size is checked against `max_size_bytes` before reading.

    `mapped=True` maps the weights instead of reading them (upload validation: no copy of the file
    in memory); the caller closes the result. Only for files nobody truncates while they are mapped.
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterFormatError(f"adapter directory {str(adapter_dir)!r} does not exist")
    config_path, weights_path = adapter_dir / CONFIG_NAME, adapter_dir / WEIGHTS_NAME
    if not weights_path.is_file():
        if (adapter_dir / PICKLE_NAME).exists():
            raise AdapterFormatError(f"the adapter has only {PICKLE_NAME}: {PICKLE_ADVICE}")
        raise AdapterFormatError(f"{WEIGHTS_NAME} is missing")  # no path: messages reach tenants
    if not config_path.is_file():
        raise AdapterFormatError(f"{CONFIG_NAME} is missing")
    size = weights_path.stat().st_size
    if max_size_bytes is not None and size > max_size_bytes:
        raise AdapterValidationError(f"{WEIGHTS_NAME} is {size} bytes, above the limit of {max_size_bytes}")
    if config_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterFormatError(f"{CONFIG_NAME} is larger than {_MAX_CONFIG_BYTES} bytes")
    config_bytes = config_path.read_bytes()
    config = json_object(config_bytes, CONFIG_NAME)
    with weights_path.open("rb") as f:
        if mapped and size > 0:
            # The map is fixed at `size` (checked above) even if the file grows later.
            return AdapterFiles(config, config_bytes, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY))
        # Bounded read: a file that grew after the stat above still cannot exceed the limit in memory.
        weights = f.read() if max_size_bytes is None else f.read(max_size_bytes + 1)
    if max_size_bytes is not None and len(weights) > max_size_bytes:
        raise AdapterValidationError(
            f"{WEIGHTS_NAME} grew past the limit of {max_size_bytes} bytes while read"
        )
    return AdapterFiles(config, config_bytes, weights)


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON (`{}` is 1), walked without recursion; stops once past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def json_object(data: bytes, what: str) -> dict[str, Any]:
    """`data` as a JSON object nested at most `_MAX_JSON_DEPTH` levels; AdapterFormatError otherwise."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise AdapterFormatError(f"{what} nests deeper than {_MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # bad UTF-8, bad JSON, or an integer past Python's 4300-digit limit
        raise AdapterFormatError(f"{what} is not valid JSON: {exc}") from exc
    if json_depth(value, _MAX_JSON_DEPTH) > _MAX_JSON_DEPTH:
        raise AdapterFormatError(f"{what} nests deeper than {_MAX_JSON_DEPTH} levels")
    if not isinstance(value, dict):
        raise AdapterFormatError(f"{what} must hold a JSON object, got {type(value).__name__}")
    return value
