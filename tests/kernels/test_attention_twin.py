"""The PyTorch twin of the paged attention kernels against the float64 oracle, over a wider grid than
the interpreter can afford; argument checks (one ValueError per kind of bad input)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kernels.attention import paged_decode_attention, paged_prefill_attention
from tests.kernels.attention_cases import decode_case, mixed_lengths, prefill_case
from tests.kernels.attention_oracle import case_id, check_decode, check_prefill, one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def grid(seed: int) -> list[dict]:
    """Every dtype x GQA group x window cell, the other axes drawn with a fixed seed."""
    rng = random.Random(seed)
    return [
        {
            "dtype": dtype,
            "group": group,
            "window": window,
            "block_size": rng.choice((16, 32)),
            "head_dim": rng.choice((64, 128)),
            "num_kv_heads": rng.choice((1, 2)),
            "seed": i,
        }
        for i, (dtype, group, window) in enumerate(itertools.product(DTYPES, (1, 2, 4), (None, 24)))
    ]


GRID = grid(seed=17)
# Soft-capped scores (Gemma 2): every dtype, with and without a window; caps near the scores' size.
SOFTCAP_GRID = [
    {"dtype": dtype, "group": 2, "window": window, "softcap": cap, "seed": 50 + i}
    for i, (dtype, window, cap) in enumerate(itertools.product(DTYPES, (None, 24), (0.7,)))
]


@pytest.mark.parametrize("cfg", SOFTCAP_GRID, ids=[case_id(c) for c in SOFTCAP_GRID])
def test_softcapped_twin_matches_float64_loop(cfg: dict) -> None:
    rng = random.Random(cfg["seed"])
    check_decode(decode_case(mixed_lengths(4, 16, longest=90, rng=rng), with_rows=True, **cfg), "torch")
    check_prefill(prefill_case([(0, 17), (37, 20), (32, 1)], **cfg), "torch")


@pytest.mark.parametrize("cfg", GRID, ids=[case_id(c) for c in GRID])
def test_decode_twin_matches_float64_loop(cfg: dict) -> None:
    rng = random.Random(cfg["seed"])
    lengths = mixed_lengths(6, cfg["block_size"], longest=150, rng=rng)
    case = decode_case(lengths, with_rows=cfg["seed"] % 2 == 0, **cfg)
    check_decode(case, "torch")


@pytest.mark.parametrize("cfg", GRID, ids=[case_id(c) for c in GRID])
def test_prefill_twin_matches_float64_loop(cfg: dict) -> None:
    rng = random.Random(cfg["seed"])
    bs = cfg["block_size"]
    # first chunks (no context), chunks after a cached prefix (block-aligned or not), single tokens
    chunks = [(0, rng.randint(1, 40)), (rng.randint(1, 90), rng.randint(1, 40)), (3 * bs, 1), (bs + 1, 20)]
    check_prefill(prefill_case(chunks, **cfg), "torch")


def test_zero_length_rows_get_zeros() -> None:
    case = decode_case([0, 19, 0], seed=5)
    out = paged_decode_attention(
        case.q, case.pool.poisoned, case.pool.block_tables, case.seq_lens, scale=case.scale, backend="torch"
    )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isfinite(out[1]).all()


def test_auto_backend_on_cpu_is_the_twin() -> None:
    case = decode_case([33, 7], seed=6)
    args = (case.q, case.pool.clean, case.pool.clean_tables, case.seq_lens)
    auto = paged_decode_attention(*args, scale=case.scale)
    assert torch.equal(auto, paged_decode_attention(*args, scale=case.scale, backend="torch"))


def _decode_args() -> dict:
    case = decode_case([5, 9], seed=7)
    return dict(
        q=case.q, kv_cache=case.pool.clean, block_tables=case.pool.clean_tables, seq_lens=case.seq_lens,
        scale=case.scale,
    )  # fmt: skip


BAD_DECODE = {
    "cache_4d": lambda a: a | {"kv_cache": a["kv_cache"][0]},
    "cache_dtype": lambda a: a | {"kv_cache": a["kv_cache"].double()},
    "q_head_dim": lambda a: a | {"q": a["q"][..., :32]},
    "q_heads_not_multiple": lambda a: a | {"q": a["q"][:, :3]},
    "q_rows": lambda a: a | {"q": a["q"][:1]},
    "q_dtype": lambda a: a | {"q": a["q"].half()},
    "tables_rows": lambda a: a | {"block_tables": a["block_tables"][:1]},
    "tables_float": lambda a: a | {"block_tables": a["block_tables"].float()},
    "seq_lens_2d": lambda a: a | {"seq_lens": a["seq_lens"].view(2, 1)},
    "seq_lens_float": lambda a: a | {"seq_lens": a["seq_lens"].float()},
    "rows_length": lambda a: a | {"rows": torch.tensor([0])},
    "scale_zero": lambda a: a | {"scale": 0.0},
    "scale_nan": lambda a: a | {"scale": float("nan")},
    "window_zero": lambda a: a | {"sliding_window": 0},
    "out_shape": lambda a: a | {"out": torch.empty(2, 4, 32)},
    "out_dtype": lambda a: a | {"out": torch.empty(2, 4, 64, dtype=torch.float16)},
    "num_splits": lambda a: a | {"num_splits": 0},
    "backend": lambda a: a | {"backend": "cuda"},
}


@pytest.mark.parametrize("bad", sorted(BAD_DECODE))
def test_decode_refuses_bad_arguments(bad: str) -> None:
    args = BAD_DECODE[bad](_decode_args())
    with pytest.raises(ValueError):
        paged_decode_attention(**args)


def _prefill_args() -> dict:
    case = prefill_case([(20, 5), (0, 3)], seed=8)
    return dict(
        q=case.q, k=case.k, v=case.v, kv_cache=case.pool.clean, block_tables=case.pool.clean_tables,
        query_starts=case.query_starts, query_lens=case.query_lens, seq_lens=case.seq_lens, scale=case.scale,
    )  # fmt: skip


BAD_PREFILL = {
    "k_rows": lambda a: a | {"k": a["k"][:-1]},
    "v_heads": lambda a: a | {"v": a["v"].repeat(1, 2, 1)},
    "k_dtype": lambda a: a | {"k": a["k"].half()},
    "query_lens_length": lambda a: a | {"query_lens": a["query_lens"][:1]},
    "query_starts_float": lambda a: a | {"query_starts": a["query_starts"].float()},
    "tables_rows": lambda a: a | {"block_tables": a["block_tables"][:1]},
    "max_query_len": lambda a: a | {"max_query_len": -1},
    "window_float": lambda a: a | {"sliding_window": 4.0},
}


@pytest.mark.parametrize("bad", sorted(BAD_PREFILL))
def test_prefill_refuses_bad_arguments(bad: str) -> None:
    args = BAD_PREFILL[bad](_prefill_args())
    with pytest.raises(ValueError):
        paged_prefill_attention(**args)


def test_triton_backend_without_cuda_or_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read by triton.knobs at each access
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_decode_attention(**_decode_args(), backend="triton")
