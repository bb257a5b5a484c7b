"""`loraserve adapter convert DIR`: a PEFT adapter's pickle weights (`adapter_model.bin`) to
`adapter_model.safetensors`, on the tenant's own machine.

The server never unpickles anything (adapters/files.py refuses `.bin`); this command is the safe path it
names. `torch.load(weights_only=True)` only rebuilds tensors and plain containers (no arbitrary code
from the pickle runs), the result must be a flat `{name: tensor}` dict, and the new file is written to a
temporary name and renamed into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapters.files import PICKLE_NAME, WEIGHTS_NAME


def convert_pickle_weights(directory: Path, *, overwrite: bool = False) -> Path:
    """Write `directory/adapter_model.safetensors` from `directory/adapter_model.bin`; its path.

    Raises ValueError naming the cause: no `.bin`, a safetensors file already there (unless
    `overwrite`), a pickle that needs more than tensors, or contents that are not `{str: tensor}`.
    """
    source, target = Path(directory) / PICKLE_NAME, Path(directory) / WEIGHTS_NAME
    if not source.is_file():
        raise ValueError(f"{source} does not exist; expected PEFT's pickle weights {PICKLE_NAME}")
    if target.exists() and not overwrite:
        raise ValueError(f"{target} already exists; pass --force to replace it")
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise ValueError(
            f"{source} cannot be read with torch.load(weights_only=True) (it needs more than tensors, "
            f"or is not a torch file): {exc}"
        ) from exc
    if not isinstance(state, dict) or not state:
        raise ValueError(f"{source} holds {type(state).__name__}; expected a dict of tensor name -> tensor")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"{source}: entry {name!r} is {type(value).__name__}; expected a tensor")
    # safetensors stores each tensor on its own: copies drop shared storage and strides
    tensors = {name: value.detach().contiguous().clone() for name, value in state.items()}
    fd, tmp = tempfile.mkstemp(prefix=".convert-", suffix=".safetensors", dir=target.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
