"""Server settings for the CPU tier (api/settings.py, api/cli/main.py): `--dtype auto` by default,
the KV pool's size and the thread count passed down to the engine, and the OpenMP wait policy set
before torch (and with it libgomp) is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from api.settings import Settings
from base_engine.engine_config import EngineConfig

_CLI = """
import os, sys
sys.argv = ["loraserve", "--help"]
from api.cli.main import main
assert "torch" not in sys.modules, "the CLI entry must run before torch loads libgomp"
try:
    main()
except SystemExit:
    pass
print("POLICY", os.environ["OMP_WAIT_POLICY"])
"""


def test_dtype_defaults_to_auto() -> None:
    assert Settings.model_fields["dtype"].default == "auto"


def test_kv_cache_and_threads_reach_the_engine_config() -> None:
    config = Settings(kv_cache_gb=1.5, kv_cache_memory_fraction=0.2, num_threads=3).engine_config()
    assert (config.kv_cache_bytes, config.kv_cache_memory_fraction, config.num_threads) == (3 << 29, 0.2, 3)
    default = Settings().engine_config()
    assert default.kv_cache_bytes is default.kv_cache_memory_fraction is default.num_threads is None


def test_cli_sets_a_passive_omp_wait_policy_unless_the_user_chose_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        done = subprocess.run(
            [sys.executable, "-c", _CLI], capture_output=True, text=True, timeout=120, env=run_env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"POLICY {expected}" in done.stdout


def test_quantization_reaches_the_engine_config_and_others_are_refused_by_name() -> None:
    import pytest

    assert Settings(quantization="int8").engine_config().quantization == "int8"
    assert Settings().engine_config().quantization is None
    with pytest.raises(ValueError, match=r"quantization 'gptq' checkpoints are not served; expected one of"):
        Settings(quantization="gptq").engine_config()


def test_speculative_off_batch_reaches_the_engine_config_and_negatives_are_refused() -> None:
    assert Settings().engine_config().speculative_off_batch is None  # measured at start
    assert Settings(speculative_off_batch=0).engine_config().speculative_off_batch == 0
    with pytest.raises(ValueError, match="speculative_off_batch"):
        Settings(speculative_off_batch=-1)
    with pytest.raises(ValueError, match="speculative_off_batch"):
        EngineConfig(speculative_off_batch=-1)
