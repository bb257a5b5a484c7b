"""Lazy reader over a Hugging Face checkpoint's safetensors files.

Follows the layout `transformers` `save_pretrained(safe_serialization=True)` writes: one
`model.safetensors`, or shards named by `model.safetensors.index.json` (`{"weight_map": {tensor:
file}}`). Tensors are read one at a time through `safetensors.safe_open` (memory-mapped), so a
loader holds at most one tensor of the file in extra memory. Pickle formats (`pytorch_model.bin`,
`*.pt`) are never loaded: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class MissingTensorError(ValueError):
    """A tensor the model needs is not in the checkpoint."""


class CheckpointReader:
    """Names, shapes and values of the tensors in `model_dir`'s safetensors files, read on demand."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self.model_dir} does not exist")
        self._file_of = self._index() if (self.model_dir / INDEX_FILE).is_file() else self._scan()
        self._names = sorted(self._file_of)
        self._handles: dict[str, Any] = {}  # file name -> open safe_open handle

    def _index(self) -> dict[str, str]:
        index_path = self.model_dir / INDEX_FILE
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: expected a JSON object with a 'weight_map'; {exc!r}") from exc
        for file in sorted(set(weight_map.values())):
            path = self.model_dir / file
            if Path(file).name != file:
                raise ValueError(f"{index_path}: shard {file!r} must be a file name inside {self.model_dir}")
            if not path.is_file():
                raise FileNotFoundError(
                    f"shard {file!r} listed in {index_path} is missing from {self.model_dir}"
                )
        return dict(weight_map)

    def _scan(self) -> dict[str, str]:
        """Without an index: `model.safetensors`, else every `*.safetensors` file (names must not repeat)."""
        single = self.model_dir / SINGLE_FILE
        files = [single] if single.is_file() else sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in self.model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
            if pickles:
                raise ValueError(
                    f"{self.model_dir} holds only pickle weights {pickles}; loraserve loads safetensors only "
                    f"(pickle can run code). Convert them, e.g. load with transformers and "
                    f"save_pretrained(dir, safe_serialization=True)"
                )
            raise FileNotFoundError(f"no *.safetensors weights in {self.model_dir}")
        file_of: dict[str, str] = {}
        for path in files:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if name in file_of:
                        raise ValueError(f"tensor {name!r} is in both {file_of[name]} and {path.name}")
                    file_of[name] = path.name
        return file_of

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return self._names

    def files(self) -> list[str]:
        """The safetensors file names, sorted."""
        return sorted(set(self._file_of.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> Path:
        """The file holding tensor `name`."""
        if name not in self._file_of:
            raise MissingTensorError(
                f"tensor {name!r} missing from checkpoint {self.model_dir} (files: {self.files()})"
            )
        return self.model_dir / self._file_of[name]

    def _handle(self, name: str) -> Any:
        file = self.file_of(name).name
        if file not in self._handles:
            self._handles[file] = safe_open(self.model_dir / file, framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name`, without reading its data."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(
        self, name: str, dtype: torch.dtype | None = None, *, expected_shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Tensor `name` (cast to `dtype` when given); checks `expected_shape` before reading the data."""
        handle = self._handle(name)
        if expected_shape is not None and self.shape(name) != tuple(expected_shape):
            raise ValueError(
                f"tensor {name!r} in {self.file_of(name)} has shape {self.shape(name)}, "
                f"expected {tuple(expected_shape)}"
            )
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for a bad/missing entry
            raise MissingTensorError(
                f"tensor {name!r} could not be read from {self.file_of(name)} (index says it is there): {exc}"
            ) from exc
        return tensor if dtype is None else tensor.to(dtype)

    def close(self) -> None:
        """Release the memory maps; the reader reopens files if used again."""
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
