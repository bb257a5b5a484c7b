"""Deterministic mode: a request's tokens and logprobs are bitwise the same alone and in any
batch — other requests and adapters, prefill chunking, prefix-cache hits, preemption — for every family
(tests/harness/families.py, with the family's quirks on).

The model's MLP is 1408 wide (bench-small's), so its down projection is a K = 1408 GEMM: the shape
where this machine's BLAS sums a row in another order once a step holds 57 rows or more. Without
the mode the same scenarios differ (checked when the mode was written: 6 of 6 random batches).
Both served dtypes are checked: float32 (MKL) and bfloat16 (oneDNN's AMX / AVX512-BF16 kernels).

The mixture-of-experts families (Qwen3-MoE, Mixtral with its window, Qwen2-MoE with its gated shared
expert) run the same checks without adapters, experts 1408 wide, with fewer draws: routing, the
per-expert GEMMs and the combine must not depend on which other rows share the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.testing import save_random_adapter
from base_engine import SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.invariant import GemmProbe, invariant_linear
from base_engine.model.config import load_model_config
from base_engine.outputs import RequestOutput
from base_engine.testing.checkpoint import save_random_checkpoint
from tests.harness.engine_inputs import preload_adapters
from tests.harness.families import CHECKPOINTS, FAMILIES

MOE_INVARIANCE_FAMILIES = ("qwen3-moe", "mixtral-window", "qwen2-moe")
MOE_EXAMPLES_PER_FAMILY = 3

VOCAB = 512
NUM_ADAPTERS = 8
# Property examples per family: the families share one budget of about 24 draws (the single-family
# test had 25), since the strategy is the same and each family's draws add to the others'.
EXAMPLES_PER_FAMILY = max(4, 24 // len(FAMILIES))


@pytest.fixture(scope="module", params=FAMILIES)
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("invariance")
    # A family's own layer count stays when it sets one (Gemma 3's first global layer is its 6th).
    layers = CHECKPOINTS[request.param].get("num_hidden_layers", 2)
    sizes = {"hidden_size": 64, "intermediate_size": 1408, "num_hidden_layers": layers, "vocab_size": VOCAB,
             "max_position_embeddings": 512}  # fmt: skip
    if "original_max_position_embeddings" in CHECKPOINTS[request.param]:
        # LongRoPE switches at 45 tokens: some drawn requests cross it, while the scenario's sharer
        # (27 + 40 tokens) still holds its short-factor prefix blocks when the target (30 + 10) arrives.
        sizes["original_max_position_embeddings"] = 44
    model_dir = save_random_checkpoint(root / "model", **{**CHECKPOINTS[request.param], **sizes})
    base = load_model_config(model_dir).base_shapes()
    adapters = [
        save_random_adapter(
            root / f"a{i}", base, rank=(4, 8, 16)[i % 3], seed=i, std=0.1, modules=base.projections
        )
        for i in range(NUM_ADAPTERS)
    ]
    return model_dir, adapters


@pytest.fixture(scope="module", params=MOE_INVARIANCE_FAMILIES)
def moe_setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Path]]:
    """An MoE family's checkpoint with 1408-wide experts (and shared expert) and no adapters."""
    family = CHECKPOINTS[request.param]
    sizes = {"hidden_size": 64, "intermediate_size": 1408, "vocab_size": VOCAB,
             "max_position_embeddings": 512}  # fmt: skip
    for width in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if width in family:
            sizes[width] = 1408
    root = tmp_path_factory.mktemp("moe-invariance")
    model_dir = save_random_checkpoint(root / "model", **{**family, **sizes})
    return model_dir, []


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    adapter: int | None
    params: dict
    arrival: int  # engine step at which it is added


def _engine(
    model_dir: Path,
    adapters: list[Path],
    *,
    chunk: int = 512,
    num_kv_blocks: int = 400,
    dtype: str = "float32",
) -> LLMEngine:
    config = EngineConfig(
        num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=32,
        max_loras=NUM_ADAPTERS, max_cpu_loras=NUM_ADAPTERS, max_lora_rank=16, attention="buckets",
    )  # fmt: skip
    engine = LLMEngine(model_dir, dtype=dtype, config=config)
    preload_adapters(engine, adapters)
    return engine


def _run(engine: LLMEngine, adapters: list[Path], reqs: list[Req]) -> dict[str, RequestOutput]:
    """Runs reqs (request id = index) to the end; the finished outputs by request id."""
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    finished: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished:
        while pending and reqs[pending[0]].arrival <= step:
            i = pending.pop(0)
            req = reqs[i]
            ref = None if req.adapter is None else engine.lora.local_ref(adapters[req.adapter])
            engine.add_request(str(i), list(req.prompt), SamplingParams(**req.params), adapter=ref)
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
        assert step < 3000, "the engine stopped making progress"
    return finished


def _answer(out: RequestOutput) -> tuple:
    assert out.error is None, out.error
    return out.token_ids, out.logprobs, out.finish_reason


def _target(prompt: list[int], adapter: int | None, temperature: float, arrival: int) -> Req:
    params = {"max_tokens": 10, "temperature": temperature, "seed": 77, "logprobs": 3, "deterministic": True}
    return Req(tuple(prompt), adapter, params, arrival)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_hit_chunking_and_preemption_leave_the_answer_alone(
    setup: tuple[Path, list[Path]], dtype: str
) -> None:
    """One scenario with each cause at once, and a check that each really happened."""
    _check_scenario(*setup, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_prefix_hit_chunking_and_preemption_leave_the_answer_alone(
    moe_setup: tuple[Path, list[Path]], dtype: str
) -> None:
    _check_scenario(*moe_setup, dtype)


def _adapter(adapters: list[Path], index: int | None) -> int | None:
    """`index`, or None on a model served without adapters (the MoE families)."""
    return index if adapters else None


def _check_scenario(model_dir: Path, adapters: list[Path], dtype: str) -> None:
    prompt = [(i * 37 + 11) % (VOCAB - 3) + 3 for i in range(30)]
    target = _target(prompt, _adapter(adapters, 2), 0.8, 0)
    alone = _run(_engine(model_dir, adapters, dtype=dtype), adapters, [target])["0"]
    # still running when the target arrives, so its prefix blocks are held (not evicted under pressure);
    # seeded and without EOS, so the scenario is the same every run (an unseeded deterministic request
    # draws its seed: its length, and with it who is preempted and what stays cached, would vary)
    sharer_params = {"max_tokens": 40, "deterministic": True, "seed": 5, "ignore_eos": True}
    sharer = Req(tuple(prompt[:24] + [9, 9, 9]), _adapter(adapters, 2), sharer_params, 0)
    others = [
        Req(tuple((j * 13 + k) % 500 + 3 for k in range(20 + j)),
            _adapter(adapters, j % NUM_ADAPTERS) if j % 3 else None,
            {"max_tokens": 12, "temperature": 0.7 if j % 2 else 0.0, "top_p": 0.9}, j % 4)
        for j in range(14)
    ]  # fmt: skip
    engine = _engine(model_dir, adapters, chunk=40, num_kv_blocks=80, dtype=dtype)
    reqs = [sharer, *others, _target(prompt, _adapter(adapters, 2), 0.8, 2)]
    got = _run(engine, adapters, reqs)[str(len(reqs) - 1)]
    assert got.num_cached_tokens > 0, "the scenario must reuse the sharer's prefix blocks"
    assert engine.scheduler.num_preemptions > 0, "the scenario must preempt"
    assert _answer(got) == _answer(alone)


prompt_st = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40)
other_st = st.tuples(  # prompt, adapter, temperature, top_p, max_tokens, deterministic, arrival, shares
    prompt_st, st.none() | st.integers(0, NUM_ADAPTERS - 1), st.sampled_from([0.0, 0.7, 1.0]),
    st.sampled_from([1.0, 0.9]), st.integers(1, 16), st.booleans(), st.integers(0, 6), st.booleans(),
)  # fmt: skip


_batch_st = {
    "prompt": st.lists(st.integers(3, VOCAB - 1), min_size=5, max_size=40),
    "adapter": st.none() | st.integers(0, NUM_ADAPTERS - 1),
    "temperature": st.sampled_from([0.0, 1.0]),
    "others": st.lists(other_st, max_size=31),
    "position": st.integers(0, 31),
    "chunk": st.sampled_from([16, 48, 96, 512]),
    "num_kv_blocks": st.sampled_from([400, 60]),
    "dtype": st.sampled_from(["float32", "bfloat16"]),
}
_settings = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@pytest.mark.slow
@settings(max_examples=EXAMPLES_PER_FAMILY, **_settings)
@given(**_batch_st)
def test_alone_equals_any_batch(setup: tuple[Path, list[Path]], **drawn) -> None:
    _check_alone_equals_batch(*setup, **drawn)


@pytest.mark.slow
@settings(max_examples=MOE_EXAMPLES_PER_FAMILY, **_settings)
@given(**_batch_st)
def test_moe_alone_equals_any_batch(moe_setup: tuple[Path, list[Path]], **drawn) -> None:
    _check_alone_equals_batch(*moe_setup, **drawn)


def _check_alone_equals_batch(
    model_dir: Path, adapters: list[Path], *, prompt, adapter, temperature, others, position, chunk,
    num_kv_blocks, dtype,
) -> None:  # fmt: skip
    target = [_target(prompt, _adapter(adapters, adapter), temperature, 0)]
    alone = _run(_engine(model_dir, adapters, dtype=dtype), adapters, target)["0"]
    batch = []
    for other_prompt, other_adapter, temp, top_p, max_tokens, det, arrival, share in others:
        if share:  # shares a prefix of the target's prompt: a prefix hit for one of them
            other_prompt = prompt[: len(prompt) // 2] + other_prompt
        params = {"max_tokens": max_tokens, "temperature": temp, "top_p": top_p, "deterministic": det}
        batch.append(Req(tuple(other_prompt), _adapter(adapters, other_adapter), params, arrival))
    at = min(position, len(batch))
    batch.insert(at, _target(prompt, _adapter(adapters, adapter), temperature, position % 4))
    engine = _engine(model_dir, adapters, chunk=chunk, num_kv_blocks=num_kv_blocks, dtype=dtype)
    got = _run(engine, adapters, batch)[str(at)]
    assert _answer(got) == _answer(alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(512, 1408, generator=gen) / 1408**0.5).to(dtype)
    row = torch.randn(1408, generator=gen).to(dtype)
    alone = invariant_linear(row[None], weight)[0]
    for rows in (2, 15, 16, 57, 100, 300):
        x = torch.randn(rows, 1408, generator=gen).to(dtype)
        x[rows // 3] = row
        assert torch.equal(invariant_linear(x, weight)[rows // 3], alone), rows
    bias = torch.randn(512, generator=gen).to(dtype)
    got = invariant_linear(x, weight, bias)
    assert got.dtype == dtype
    # bf16: the pieces' sum is rounded once, so it stays within one bf16 ulp of the unsplit GEMM.
    tolerance = {"atol": 3e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), **tolerance)
    assert GemmProbe(dtype).check({(512, 1408), (1024, 64)}) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 1408])
def test_narrow_projections_keep_their_tail_rows(dtype: torch.dtype, width: int) -> None:
    """A one-output projection (Qwen2-MoE's shared-expert gate) on MKL: the last M mod 4 rows of a
    step were summed in another order (fp32, K = 1408: row 16 of 17) until the weight was padded."""
    gen = torch.Generator().manual_seed(width)
    weight = torch.randn(1, width, generator=gen).to(dtype)
    row = torch.randn(width, generator=gen).to(dtype)
    alone = invariant_linear(row[None], weight)[0]
    for rows in (17, 18, 19, 21, 33, 57, 100):
        x = torch.randn(rows, width, generator=gen).to(dtype)
        for at in range(rows):
            batch = x.clone()
            batch[at] = row
            assert torch.equal(invariant_linear(batch, weight)[at], alone), (rows, at)
    assert invariant_linear(x, weight).shape == (100, 1)


def test_refused_where_it_cannot_hold(setup: tuple[Path, list[Path]]) -> None:
    model_dir, _ = setup
    engine = LLMEngine(model_dir, dtype="float16", config=EngineConfig(num_kv_blocks=32, block_size=4))
    with pytest.raises(ValueError, match="deterministic mode needs dtype float32 or bfloat16"):
        engine.add_request("x", [5, 6, 7], SamplingParams(deterministic=True))
    engine.add_request("y", [5, 6, 7], SamplingParams(max_tokens=2))  # the rest of the engine serves on
    with pytest.raises(ValueError, match="deterministic mode needs dtype float32 or bfloat16"):
        LLMEngine(model_dir, dtype="float16", config=EngineConfig(num_kv_blocks=32, deterministic=True))
