"""LoRA on Phi-3 (fused `qkv_proj` / `gate_up_proj`) against PEFT: the parsed factors rebuild PEFT's
fused deltas exactly, mixed batches (base rows, several adapters, every targetable module, rank and
alpha patterns) are token-identical to PEFT on both attention paths and both LoRA schedules, and
q_proj-style names on the fused checkpoint are refused naming the fused modules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters import AdapterFormatError, load_adapter
from adapters.types import FUSED_PROJECTIONS
from base_engine import LLM, SamplingParams
from kernels.sgmv import cost_model, torch_bag, torch_fused
from kernels.sgmv.cost_model import ScheduleCosts
from tests.adapters.engine_helpers import make_adapter, peft_model
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import preload_adapters, random_prompts
from tests.harness.peft_adapters import edit_config, peft_deltas, save_peft_adapter, tiny_shapes

MAX_NEW = 8
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)

FORMAT_CASES: dict[str, dict[str, Any]] = {
    "all-fused": {"r": 8, "lora_alpha": 16, "target_modules": FUSED},
    "all-linear-rslora": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": "all-linear"},
    "patterns": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["qkv_proj", "gate_up_proj"],
        "rank_pattern": {"layers.1.self_attn.qkv_proj": 6},
        "alpha_pattern": {"gate_up_proj": 3.0},
        "layers_to_transform": [1],
    },
    "regex": {"r": 2, "lora_alpha": 4, "target_modules": r".*\.(qkv_proj|down_proj)"},
}


@pytest.mark.parametrize("case", sorted(FORMAT_CASES))
def test_split_factors_rebuild_peft_fused_deltas(case: str, tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / case, "phi3", seed=3, **FORMAT_CASES[case])
    ours = load_adapter(adapter_dir, base=tiny_shapes("phi3"))
    theirs = peft_deltas(adapter_dir, "phi3")  # keyed by the fused names
    rebuilt = set()
    for (layer, module), delta in theirs.items():
        parts = FUSED_PROJECTIONS.get(module, (module,))
        pairs = [ours.weights[(layer, part)] for part in parts]
        assert all(p.a is pairs[0].a or torch.equal(p.a, pairs[0].a) for p in pairs)  # one shared A
        ours_delta = torch.cat([p.scale * (p.b.double() @ p.a.double()) for p in pairs])
        torch.testing.assert_close(ours_delta, delta, rtol=1e-12, atol=1e-12, msg=f"{case} {layer} {module}")
        rebuilt |= {(layer, part) for part in parts}
    assert rebuilt == set(ours.weights)


@pytest.mark.parametrize(
    ("targets", "said"),
    [
        (["q_proj", "v_proj"], "fuses q_proj, k_proj, v_proj into qkv_proj"),
        (["gate_proj"], "fuses gate_proj, up_proj into gate_up_proj"),
        (r".*\.q_proj", "adapter targets no projection"),
    ],
)
def test_unfused_names_on_a_fused_checkpoint_are_refused(targets: Any, said: str, tmp_path: Path) -> None:
    """PEFT itself refuses these on Phi-3 ("not found in the base model"): never served as a no-op."""
    adapter_dir = save_peft_adapter(tmp_path / "a", "phi3", r=4, target_modules=["qkv_proj"])
    edit_config(adapter_dir, target_modules=targets)
    with pytest.raises(AdapterFormatError, match=said) as info:
        load_adapter(adapter_dir, base=tiny_shapes("phi3"))
    assert "qkv_proj" in str(info.value)


def test_null_targets_and_fused_names_elsewhere_are_refused(tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", "phi3", r=4, target_modules=["qkv_proj"])
    edit_config(adapter_dir, target_modules=None)  # PEFT: "Please specify `target_modules`" for phi3
    with pytest.raises(AdapterFormatError, match="no default targets for phi3"):
        load_adapter(adapter_dir, base=tiny_shapes("phi3"))
    edit_config(adapter_dir, target_modules=["qkv_proj"])
    with pytest.raises(AdapterFormatError, match="'qkv_proj' names no module of a llama model"):
        load_adapter(adapter_dir, base=tiny_shapes("llama"))


@pytest.fixture(scope="module")
def phi3_adapters(tiny_phi3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phi3-adapters")
    return {
        "fused": make_adapter(
            tiny_phi3_dir, root / "fused", seed=1, r=8, lora_alpha=16, target_modules=FUSED
        ),
        "patterns": make_adapter(
            tiny_phi3_dir,
            root / "patterns",
            seed=2,
            r=4,
            lora_alpha=8,
            target_modules="all-linear",
            rank_pattern={"qkv_proj": 12, "layers.1.mlp.gate_up_proj": 2},
            alpha_pattern={"o_proj": 3.0},
        ),  # fmt: skip
        "attn-only": make_adapter(
            tiny_phi3_dir,
            root / "attn",
            seed=3,
            r=16,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["qkv_proj"],
        ),
        "mlp": make_adapter(
            tiny_phi3_dir,
            root / "mlp",
            seed=4,
            r=4,
            lora_alpha=8,
            target_modules=["gate_up_proj", "down_proj"],
        ),
        "o-down-layer0": make_adapter(
            tiny_phi3_dir,
            root / "odown",
            seed=5,
            r=8,
            lora_alpha=16,
            target_modules=["o_proj", "down_proj"],
            layers_to_transform=[0],
        ),  # fmt: skip
    }


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["buckets", "paged"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["segments-and-bags", "bags-only"])
def test_mixed_batch_matches_peft(
    tiny_phi3_dir, phi3_adapters, attention: str, deterministic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks (long segments: the fused segment loop) and decodes (short ones: the bag schedule)
    in one step, or every row in bags (deterministic mode); prompts include ones that cross LongRoPE's
    original context while decoding."""
    calls = {"add_lora_bag": 0, "add_lora_segments": 0}
    for module, name in ((torch_bag, "add_lora_bag"), (torch_fused, "add_lora_segments")):
        monkeypatch.setattr(module, name, _counted(getattr(module, name), calls, name))
    # Segments of <= 2 rows to bags, longer ones to the loop, whatever the widths (cost_model.py: a
    # segment saves W us out of the loop, a bag row costs 0.4 W us)
    split = ScheduleCosts(0.0, 0.4e-6, 0.0, 1e-6, 0.0)
    monkeypatch.setattr(cost_model, "costs_for", lambda dtype, device: split)
    # Five adapters decoding one or two rows each: enough short segments for the bag schedule.
    names = [None, "fused", "patterns", "attn-only", "mlp", "o-down-layer0", "fused", None, "mlp"]
    prompts = random_prompts(len(names), 500, 3, 30, seed=41)
    llm = LLM(
        tiny_phi3_dir, num_kv_blocks=160, block_size=4, max_loras=5, max_lora_rank=16,
        max_num_batched_tokens=96, attention=attention,
    )  # fmt: skip
    preload_adapters(llm.engine, list(phi3_adapters.values()))  # all five decode side by side
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True, deterministic=deterministic
    )
    outs = llm.generate(prompts, params, adapters=[phi3_adapters[n] if n else None for n in names])
    compared = 0
    for name in set(names):
        reference = peft_model(tiny_phi3_dir, phi3_adapters[name] if name else None)
        for prompt, n, out in zip(prompts, names, outs, strict=True):
            if n == name:
                assert out.finish_reason == "length", out.error
                ref_tokens, ref_lps = hf_greedy(reference, prompt, MAX_NEW)
                compared += assert_greedy_match(
                    out.token_ids, out.logprobs, ref_tokens, ref_lps, label=str(n)
                )
    assert compared >= 6 * MAX_NEW
    assert calls["add_lora_bag"] > 0 and (calls["add_lora_segments"] > 0) != deterministic, calls


def _counted(fn: Callable[..., None], calls: dict[str, int], name: str) -> Callable[..., None]:
    def counted(*args: Any, **kwargs: Any) -> None:
        calls[name] += 1
        fn(*args, **kwargs)

    return counted
