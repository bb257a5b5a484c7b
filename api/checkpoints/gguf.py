"""GGUF files (llama.cpp, Ollama) -> a Hugging Face checkpoint directory the engine loads.

`transformers` (with the `gguf` package) reads a GGUF file and de-quantizes its tensors; this module
writes what it read as a plain float32 checkpoint: `model.safetensors` (the tied `lm_head.weight` left
out, as `save_pretrained` does), `config.json` (no `quantization_config`, `architectures` set, so it
reloads as an ordinary model), the tokenizer files with the GGUF's chat template, and
`generation_config.json` with the GGUF's `general.sampling.*` defaults when it has any. The result
reloads bit-identically in `transformers` and in our engine. The config is transformers' reading of
the file, completed from its metadata (api/checkpoints/gguf_config.py: Llama, Mistral, Qwen2/3, Gemma
2/3, Phi-3); a file whose tensors and the model's parameters do not match one to one is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from api.checkpoints.gguf_config import ROPE_TENSORS, SPECIAL_IDS, architecture_of, complete_config

logger = logging.getLogger(__name__)

# Bumped whenever the written checkpoint changes, so that cached conversions are redone.
CONVERSION_VERSION = 2
MARKER_FILE = "loraserve-conversion.json"
# GGUF `general.sampling.*` key -> generation_config.json key (what llama.cpp's converter writes).
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def file_sha256(path: Path, *, progress: bool = False) -> str:
    """Hex SHA-256 of a file, read in 4 MiB pieces (a progress bar on stderr when `progress`)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    bar = _bar(total=size, desc=f"hashing {path.name}", unit="B", enabled=progress)
    with path.open("rb") as f, bar:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _bar(*, total: int, desc: str, unit: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, leave=False)


def gguf_sampling_defaults(gguf_path: Path) -> dict[str, float | int]:
    """generation_config.json sampling keys from the GGUF's `general.sampling.*` metadata (often none)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    out: dict[str, float | int] = {}
    for key, name in _GGUF_SAMPLING.items():
        field = reader.fields.get(key)
        if field is not None:
            value = field.contents()
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def is_converted(out_dir: Path) -> bool:
    """Whether `out_dir` holds a finished conversion of the current format."""
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("version") == CONVERSION_VERSION
    except (OSError, json.JSONDecodeError):
        return False


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    sha256: str | None = None,
    extra_generation_config: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> Path:
    """Write the float32 HF checkpoint of `gguf_path` into `out_dir` (made atomically: temp + rename).

    `extra_generation_config` overrides or adds generation_config.json keys (e.g. a model card's
    recommended sampling). Returns `out_dir`; an existing finished conversion there is kept as is.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        _write_checkpoint(gguf_path, tmp, extra_generation_config or {})
        marker = {"version": CONVERSION_VERSION, "source": gguf_path.name, "sha256": sha256}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        if out_dir.exists() and not is_converted(out_dir):  # an unfinished or outdated conversion
            shutil.rmtree(out_dir)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not is_converted(out_dir):  # else another process finished the same conversion first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s into %s", gguf_path, out_dir)
    return out_dir


def _write_checkpoint(gguf_path: Path, out: Path, extra_generation_config: Mapping[str, Any]) -> None:
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    metadata = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not k.startswith("tokenizer.") or k in SPECIAL_IDS
    }
    by_name = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in t.shape) for name, t in by_name.items()}

    def read_tensor(name: str) -> Any:
        t = by_name[name]
        return dequantize(t.data, t.tensor_type).reshape(-1)

    architecture_of(metadata, str(gguf_path))  # an unsupported file fails before the slow part
    src, name = str(gguf_path.parent), gguf_path.name
    guessed = AutoConfig.from_pretrained(src, gguf_file=name).to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        guessed.pop(key, None)
    fields = complete_config(guessed, metadata, shapes, read_tensor, source=str(gguf_path))
    config = AutoConfig.for_model(**fields)
    model, info = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, config=config, dtype=torch.float32, output_loading_info=True
    )
    tied = bool(config.tie_word_embeddings)
    _check_every_tensor_loaded(model, info, set(shapes), tied=tied, source=str(gguf_path))
    tensors = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    fields["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(str(out))
    generation = {
        k: v
        for k, v in model.generation_config.to_diff_dict().items()
        if k in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    generation |= gguf_sampling_defaults(gguf_path)
    generation |= dict(extra_generation_config)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _check_every_tensor_loaded(
    model: Any, info: Mapping[str, Any], gguf_tensors: set[str], *, tied: bool, source: str
) -> None:
    """Refuse a file whose tensors and the model's parameters do not match one to one: transformers
    would leave an unmatched parameter randomly initialised and drop an unmatched tensor, silently."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    missing = sorted(k for k in info.get("missing_keys", ()) if not (tied and k == "lm_head.weight"))
    if missing:
        raise ValueError(f"{source}: the GGUF has no tensor for {missing}; refusing a half-loaded model")
    mapped = set(get_gguf_hf_weights_map(model, TensorProcessor()))
    unused = sorted(gguf_tensors - mapped - set(ROPE_TENSORS))
    if unused:
        raise ValueError(f"{source}: GGUF tensors {unused[:8]} have no place in {type(model).__name__}")
