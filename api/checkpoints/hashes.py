"""The base model's content hash for provenance, computed once and cached in the data dir.

What is hashed:
- a checkpoint converted from a GGUF file (the default SmolLM2 model, any `--model x.gguf`): the GGUF
  file's SHA-256, which the conversion already computed and recorded (api/checkpoints/sources.py,
  api/checkpoints/gguf.py); the conversion itself is a function of the file and the loraserve build;
- any other checkpoint: the SHA-256 of the `sha256sum` listing of the safetensors files the engine
  loads (the shards of `model.safetensors.index.json`, else `model.safetensors`, else every
  `*.safetensors`), in byte order of their names. Reproduce it with
  `cd <checkpoint> && LC_ALL=C sha256sum model.safetensors | sha256sum` (or the shards' names).

Hashing a large checkpoint takes seconds, so each file's hash is kept in `<data dir>/model-hashes.json`
keyed by (absolute path, size, mtime): a restart re-reads only files that changed. A hash that cannot
be computed is "unknown" (logged); it never stops the server from starting.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from api.checkpoints.gguf import MARKER_FILE, file_sha256, is_converted
from registry.provenance import UNKNOWN

logger = logging.getLogger(__name__)

CACHE_FILE = "model-hashes.json"
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def base_model_sha256(model_dir: Path, *, cache_dir: Path) -> str:
    model_dir = Path(model_dir)
    try:
        if is_converted(model_dir):
            recorded = json.loads((model_dir / MARKER_FILE).read_text()).get("sha256")
            if isinstance(recorded, str) and recorded:
                return recorded
        return _manifest_sha256(weight_files(model_dir), Path(cache_dir) / CACHE_FILE)
    except (OSError, ValueError) as exc:
        logger.warning("could not hash the base model in %s for provenance: %s", model_dir, exc)
        return UNKNOWN


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files the engine loads (base_engine/model/checkpoint.py's rule), sorted by name."""
    index = model_dir / _INDEX_FILE
    if index.is_file():
        shards = json.loads(index.read_text())["weight_map"].values()
        return [model_dir / name for name in sorted(set(shards))]
    single = model_dir / _SINGLE_FILE
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError("no *.safetensors weights")
    return files


def _manifest_sha256(files: list[Path], cache_path: Path) -> str:
    cache = _read_cache(cache_path)
    lines = []
    is_changed = False
    for path in files:
        stat = path.stat()
        key = str(path.resolve())
        entry = cache.get(key)
        stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if not (isinstance(entry, dict) and stamp.items() <= entry.items()):
            logger.info("hashing %s for provenance (once; cached in %s)", path.name, cache_path)
            entry = {**stamp, "sha256": file_sha256(path)}
            cache[key] = entry
            is_changed = True
        lines.append(f"{entry['sha256']}  {path.name}\n")  # sha256sum's own format
    if is_changed:
        _write_cache(cache_path, cache)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _read_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _write_cache(path: Path, cache: dict[str, dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as exc:  # a read-only data dir: the hash is still right, only not remembered
        logger.warning("could not cache the base model's hash in %s: %s", path, exc)
