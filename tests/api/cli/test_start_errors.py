"""Start-up errors are one line: `loraserve serve --model` on a checkpoint we cannot serve prints only the
message (naming the architecture and the supported list) on stderr and exits with status 2, before the
database or anything else is made (api/bootstrap.py: StartError)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.harness.servers import LORASERVE


def test_unsupported_architecture_is_one_line_exit_2(tmp_path: Path) -> None:
    model = tmp_path / "bert"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"})
    )
    data_dir = tmp_path / "data"
    out = subprocess.run(
        [LORASERVE, "serve", "--model", str(model), "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and "BertForMaskedLM" in lines[0]
    assert "LlamaForCausalLM" in lines[0] and "Qwen3ForCausalLM" in lines[0]
    assert "Traceback" not in out.stderr + out.stdout
    assert not list(data_dir.glob("*.db")), "the model is checked before the database is made"
