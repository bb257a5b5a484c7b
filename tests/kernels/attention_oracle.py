"""The float64 loop oracle for the paged attention kernels (kernels/attention) and the checks built on
it: run a kernel backend on a case (attention_cases.py), clean and poisoned, and compare within the
dtype's tolerance. Shared by test_attention_reference.py (which pins the oracle to the engine's torch
path), test_attention_twin.py, test_attention_interpreter.py and test_attention_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from tests.kernels.attention_cases import DecodeCase, PrefillCase, torch_on_one_thread

# |got - want| <= ATOL + RTOL * |want| per dtype; outputs are convex mixes of N(0, 1) values.
# fp32: IEEE dots; fp16/bf16: inputs rounded alike for the oracle, P rounded to the dtype before P @ V
# (as on tensor cores) and the output rounded once.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """For the attention test modules (autouse there): torch on one thread. Two threads of a loaded
    2-core machine run these small ops up to 100x slower (OpenMP waits), and no result depends on it."""
    with torch_on_one_thread():
        yield


def _attend64(q: Tensor, keys: Tensor, values: Tensor, scale: float, softcap: float | None) -> Tensor:
    """One query token, float64: q [H, D], keys/values [L, KVH, D] -> [H, D]; zeros when L == 0.
    Head h reads KV head h // G; scores soft-capped (cap * tanh(s / cap)) when softcap is set.
    Elementwise products and sums (small float64 matmuls crawl on CPU)."""
    num_heads, num_kv_heads = q.shape[0], keys.shape[1]
    if keys.shape[0] == 0:
        return torch.zeros_like(q)
    kv_of_head = torch.arange(num_heads, device=q.device) // (num_heads // num_kv_heads)
    keys, values = keys[:, kv_of_head].transpose(0, 1), values[:, kv_of_head].transpose(0, 1)  # [H, L, D]
    scores = (keys * q[:, None, :]).sum(-1) * scale  # [H, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores, dim=-1)
    return (probs[..., None] * values).sum(1)


@torch_on_one_thread()
def decode_oracle(case: DecodeCase) -> Tensor:
    """float64 [B, H, D]: row b's output, by a loop over rows, read from the clean cache (on q's device)."""
    cache, tables = case.pool.clean.double(), case.pool.clean_tables
    bs, q, device = case.pool.block_size, case.q.double(), case.q.device
    rows = case.rows.tolist() if case.rows is not None else list(range(len(case.seq_lens)))
    out = torch.zeros(len(rows), q.shape[1], q.shape[2], dtype=torch.float64, device=device)
    for b, n in enumerate(case.seq_lens.tolist()):
        lo = 0 if case.window is None else max(0, n - case.window)
        pos = torch.arange(lo, n, device=device)
        blocks, offsets = tables[b, pos // bs], pos % bs
        keys, values = cache[0, blocks, offsets], cache[1, blocks, offsets]
        out[b] = _attend64(q[rows[b]], keys, values, case.scale, case.softcap)
    return out


@torch_on_one_thread()
def prefill_oracle(case: PrefillCase) -> Tensor:
    """float64 [T, H, D] (zeros outside the chunks): a loop over chunks and queries (on q's device)."""
    cache, tables = case.pool.clean.double(), case.pool.clean_tables
    bs, device = case.pool.block_size, case.q.device
    q, k, v = (t.double() for t in (case.q, case.k, case.v))
    out = torch.zeros_like(q)
    chunks = zip(case.query_starts.tolist(), case.query_lens.tolist(), case.seq_lens.tolist(), strict=True)
    for n, (start, m, seq_len) in enumerate(chunks):
        ctx = seq_len - m
        for i in range(m):
            p = ctx + i
            lo = 0 if case.window is None else max(0, p - case.window + 1)
            cached = torch.arange(min(lo, ctx), ctx, device=device)
            own = torch.arange(max(lo, ctx), p + 1, device=device) - ctx + start  # rows of k/v
            blocks, offsets = tables[n, cached // bs], cached % bs
            keys = torch.cat([cache[0, blocks, offsets], k[own]])  # [L, KVH, D]
            values = torch.cat([cache[1, blocks, offsets], v[own]])
            out[start + i] = _attend64(q[start + i], keys, values, case.scale, case.softcap)
    return out


def assert_close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    got64, want = got.double(), want.to(got.device)
    assert torch.isfinite(got64).all(), "non-finite output"
    err = (got64 - want).abs()
    bound = atol + rtol * want.abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"max err {err.max().item():.3g}; at {worst.item()}: got {got64.flatten()[worst].item():.6g}, "
        f"want {want.flatten()[worst].item():.6g} ({dtype})"
    )


def run_decode(case: DecodeCase, backend: str, *, poisoned: bool, **kwargs) -> Tensor:
    """The op on the clean or poisoned pool; returns [B, H, D] (the rows' outputs)."""
    from kernels.attention import paged_decode_attention

    pool = case.pool
    cache, tables = (pool.poisoned, pool.block_tables) if poisoned else (pool.clean, pool.clean_tables)
    out = paged_decode_attention(
        case.q, cache, tables, case.seq_lens, scale=case.scale, sliding_window=case.window,
        softcap=case.softcap, rows=case.rows, backend=backend, **kwargs,
    )  # fmt: skip
    return out if case.rows is None else out[case.rows]


def run_prefill(case: PrefillCase, backend: str, *, poisoned: bool, **kwargs) -> Tensor:
    """The op on the clean or poisoned pool, into an out pre-filled with NaN; returns out [T, H, D]."""
    from kernels.attention import paged_prefill_attention

    pool = case.pool
    cache, tables = (pool.poisoned, pool.block_tables) if poisoned else (pool.clean, pool.clean_tables)
    out = torch.full_like(case.q, float("nan"))
    paged_prefill_attention(
        case.q, case.k, case.v, cache, tables, case.query_starts, case.query_lens, case.seq_lens,
        scale=case.scale, sliding_window=case.window, softcap=case.softcap, out=out, backend=backend,
        **kwargs,
    )  # fmt: skip
    return out


def check_decode(case: DecodeCase, backend: str, **kwargs) -> None:
    """Matches the oracle, and the poisoned pool gives bit-identical rows."""
    clean = run_decode(case, backend, poisoned=False, **kwargs)
    assert_close(clean, decode_oracle(case), case.dtype)
    poisoned = run_decode(case, backend, poisoned=True, **kwargs)
    assert torch.equal(poisoned, clean), "a stale slot changed a row's result"


def check_prefill(case: PrefillCase, backend: str, **kwargs) -> None:
    """Chunk rows match the oracle, other rows of out stay untouched, the poisoned pool is bit-identical."""
    clean = run_prefill(case, backend, poisoned=False, **kwargs)
    inside = case.chunk_rows
    assert clean[~inside].isnan().all(), "a row outside every chunk was written"
    assert_close(clean[inside], prefill_oracle(case)[inside], case.dtype)
    poisoned = run_prefill(case, backend, poisoned=True, **kwargs)
    assert torch.equal(poisoned[inside], clean[inside]), "a stale slot changed a row's result"


def case_id(cfg: dict) -> str:
    parts = []
    for key, value in cfg.items():
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        parts.append(f"{key}={value}")
    return ",".join(parts)
