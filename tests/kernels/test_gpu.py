"""Real compilation on a CUDA GPU at Llama shapes (skipped without CUDA; run by benchmarks/gpu_check.sh).

A sampled grid of the issue's large shapes: hidden 4096 / 11008 / 14336, ranks 8-128, up to 128 slots,
T up to 256, fp16 / bf16 / fp32, against the float64 per-slot oracle. Also: no device-to-host sync in
a call with a prebuilt meta, and the torch twin on CUDA tensors (device ranks: the masked gather path).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.sgmv import build_meta
from tests.kernels.reference import (
    POPULARITIES,
    assert_matches,
    case_id,
    expected_output,
    make_case,
    run_add_lora,
)

pytestmark = pytest.mark.gpu

SHAPES = (  # (H_in, output slices): Llama-3-8B qkv, Llama-2-7B MLP, Llama-3-8B gate_up / down
    (4096, (4096, 1024, 1024)),
    (4096, (11008, 11008)),
    (11008, (4096,)),
    (14336, (4096,)),
    (4096, (14336,)),
)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gpu_grid(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        hidden_in, outs = SHAPES[i % len(SHAPES)]
        max_rank = rng.choice((8, 16, 32, 64, 128))
        cases.append(
            {
                "popularity": POPULARITIES[i % len(POPULARITIES)],
                "dtype": DTYPES[i % len(DTYPES)],
                "num_tokens": rng.choice((1, 3, 16, 64, 133, 256)),
                "hidden_in": hidden_in,
                "out_sizes": outs,
                # keep the stacks near 1 GiB: many slots only with small ranks
                "num_slots": rng.choice((8, 32, 128)) if max_rank <= 32 else rng.choice((4, 16)),
                "max_rank": max_rank,
                "per_slice": rng.random() < 0.5,
                "seed": 1000 + i,
            }
        )
    return cases


GRID = gpu_grid(count=21, seed=5)


@pytest.mark.parametrize("cfg", GRID, ids=[case_id(c) for c in GRID])
def test_triton_matches_float64_at_llama_shapes(cfg: dict) -> None:
    case = make_case(**cfg, device="cuda")
    expected, before = expected_output(case, by_slot=True), case.buf.clone()
    run_add_lora(case, "triton", meta=build_meta(case.token_slots, cfg["num_slots"]))
    assert_matches(case, expected, before, cfg["dtype"])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prebuilt_meta_call_never_syncs(backend: str) -> None:
    case = make_case(num_tokens=64, hidden_in=4096, out_sizes=(4096, 1024, 1024), num_slots=16, max_rank=16,
                     popularity="zipf", dtype=torch.bfloat16, seed=3, device="cuda")  # fmt: skip
    meta = build_meta(case.token_slots, 16)
    expected, before = expected_output(case, by_slot=True), case.buf.clone()
    run_add_lora(case, backend, meta=meta)  # warm-up: compiles outside the guarded region
    case.buf.copy_(before)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_add_lora(case, backend, meta=meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches(case, expected, before, torch.bfloat16)


@pytest.mark.parametrize("popularity", ["distinct", "skewed", "some_none"])
def test_torch_twin_on_cuda_with_device_ranks(popularity: str) -> None:
    case = make_case(num_tokens=48, hidden_in=1024, out_sizes=(1024, 256), num_slots=16, max_rank=32,
                     popularity=popularity, dtype=torch.float32, seed=4, device="cuda")  # fmt: skip
    expected, before = expected_output(case, by_slot=True), case.buf.clone()
    run_add_lora(case, "torch", meta=build_meta(case.token_slots, 16))
    assert_matches(case, expected, before, torch.float32)
