"""Shared pytest set-up: fixture plugins live in tests/harness/ (one module per real part)."""

import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples every run (`make test`, CI): a red run is reproducible, never a
# rare draw on one machine. HYPOTHESIS_PROFILE=explore draws fresh ones each run, to hunt.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

os.environ.setdefault("TRITON_INTERPRET", "1")
# Servers in tests (the harness's subprocesses and in-process `Settings`) serve float32, the dtype the
# oracles (`transformers`, `peft`, float64 loops) are compared in at float32 tolerances; `--dtype auto`
# would be bfloat16 on a CPU with AMX / AVX512-BF16. Tests of other dtypes pass `--dtype` themselves.
os.environ.setdefault("LORASERVE_DTYPE", "float32")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

pytest_plugins = [
    "tests.harness.models",
    "tests.harness.postgres",
    "tests.harness.s3",
    "tests.harness.shared_server",
    "tests.harness.usage",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
