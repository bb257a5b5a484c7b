"""The coverage report against a float64 recomputation from PEFT's own deltas and the base weights; an
adapter that changes nothing refused by name; a negligible one accepted with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters.types import AdapterValidationError
from adapters.validation import validate_adapter
from tests.harness.peft_adapters import edit_tensors, peft_deltas, save_peft_adapter, tiny_model, tiny_shapes

LIMITS = {"max_lora_rank": 16, "max_size_bytes": 1 << 22}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _weight_norms(model_type: str = "llama") -> dict[tuple[int, str], float]:
    model = tiny_model(model_type)
    norms = {}
    for layer, block in enumerate(model.model.layers):
        for module in ALL:
            parent = block.self_attn if module in ALL[:4] else block.mlp
            norms[(layer, module)] = float(
                torch.linalg.norm(getattr(parent, module).weight.detach().double())
            )
    return norms


def test_report_matches_float64_recomputation(tmp_path: Path) -> None:
    directory = save_peft_adapter(
        tmp_path / "a", r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"o_proj": 4},
        alpha_pattern={"down_proj": 3.0}, layers_to_transform=[1],
    )  # fmt: skip
    norms = _weight_norms()
    report = validate_adapter(directory, base=tiny_shapes(), weight_norms=norms, **LIMITS).coverage
    assert report is not None and report.kinds == ("lora",) and report.warning is None
    theirs = peft_deltas(directory)
    assert (
        [(m.layer, m.module) for m in report.modules]
        == [(1, m) for m in ALL]
        == sorted(theirs, key=lambda k: ALL.index(k[1]))
    )
    for m in report.modules:
        fro = float(torch.linalg.norm(theirs[(m.layer, m.module)]))
        assert m.delta_fro == pytest.approx(fro, rel=1e-6)
        assert m.relative_delta == pytest.approx(fro / norms[(m.layer, m.module)], rel=1e-6)
    by_name = {m.module: m for m in report.modules}
    assert (
        by_name["o_proj"].rank == 4
        and by_name["o_proj"].scale == 4.0
        and by_name["down_proj"].scale == 3.0 / 8
    )
    stored = report.as_json()
    assert list(stored["layers"]) == ["1"] and stored["layers"]["1"]["q_proj"]["rank"] == 8
    assert stored["layers"]["1"]["q_proj"]["relative_delta"] == by_name["q_proj"].relative_delta


def test_an_adapter_that_changes_nothing_is_refused(tmp_path: Path) -> None:
    untrained = save_peft_adapter(tmp_path / "z", r=4, target_modules=["q_proj"], init_lora_weights=True)
    with pytest.raises(
        AdapterValidationError,
        match="the adapter changes nothing: scale \\* lora_B @ lora_A is zero in all 2",
    ):
        validate_adapter(untrained, base=tiny_shapes(), **LIMITS)
    # An untrained DoRA adapter still rescales (its magnitude): kept, kind "dora".
    dora = save_peft_adapter(
        tmp_path / "d", r=4, target_modules=["q_proj"], init_lora_weights=True, use_dora=True
    )
    report = validate_adapter(dora, base=tiny_shapes(), **LIMITS).coverage
    assert report is not None and report.kinds == ("dora",) and report.modules[0].relative_delta is None


def test_negligible_delta_is_accepted_with_a_warning(tmp_path: Path) -> None:
    directory = save_peft_adapter(tmp_path / "n", r=4, target_modules=["q_proj", "v_proj"])
    edit_tensors(directory, lambda t: {k: v * 1e-8 if "lora_B" in k else v for k, v in t.items()})
    summary = validate_adapter(directory, base=tiny_shapes(), weight_norms=_weight_norms(), **LIMITS)
    assert summary.coverage is not None and summary.coverage.warning is not None
    assert summary.coverage.warning.startswith("negligible change: the largest relative delta")
    assert all(m.relative_delta < 1e-6 for m in summary.coverage.modules)
