"""Float64 loop oracle and case generators for the paged attention kernels (kernels/attention), shared by
test_attention_twin.py, test_attention_interpreter.py and test_attention_gpu.py; its own tests pin the
oracle to the engine's torch path (base_engine.attention), so kernels and engine mean the same thing.

Cases are "realistic": blocks scattered through the pool as the block manager leaves them, context
lengths mixed (1, block edges +-1, long ones), some query heads peaky (large logits, so the online
softmax's rescaling matters), sliding windows that free whole blocks. Every case comes twice: clean,
and poisoned, where each slot no row may read (beyond a length, before a window, the chunk's own
positions in the cache, spare blocks, table padding, freed blocks) holds NaN, +Inf or -Inf.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor

# |got - want| <= ATOL + RTOL * |want| per dtype; outputs are convex mixes of N(0, 1) values.
# fp32: IEEE dots; fp16/bf16: inputs rounded alike for the oracle, P rounded to the dtype before P @ V
# (as on tensor cores) and the output rounded once.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
POISONS = (float("nan"), float("inf"), float("-inf"))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The oracles' many tiny float64 ops run ~20x faster on one thread than on two of a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Pool:
    """One layer's block pool and the tables into it: the clean cache and its poisoned twin."""

    clean: Tensor  # [2, num_blocks, bs, KVH, D]
    poisoned: Tensor  # same, with every slot no row may read set to NaN/+Inf/-Inf
    block_tables: Tensor  # [N, max_blocks] (padding and freed entries point at a poisoned spare block)
    clean_tables: Tensor  # the same tables with the padding / freed entries at block 0
    readable: list[tuple[int, int]]  # per sequence: positions [lo, hi) whose slots may be read

    @property
    def block_size(self) -> int:
        return self.clean.shape[2]


@_one_thread()
def make_pool(
    spans: list[tuple[int, int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    rng: random.Random,
    gen: torch.Generator,
    device: str = "cpu",
) -> Pool:
    """spans[b] = (lo, hi, total): sequence b has `total` positions allotted blocks, of which [lo, hi)
    are readable (written, inside the window); blocks wholly before lo are 'freed' in the poisoned tables."""
    bs = block_size
    num_blocks = [-(-total // bs) for _, _, total in spans]
    spare = 3
    pool_size = sum(num_blocks) + spare + 1
    ids = list(range(1, pool_size))  # block 0 stays unused: the clean tables' padding
    rng.shuffle(ids)
    trash = ids.pop()  # a poisoned block that padding / freed entries point at
    width = max([1, *num_blocks])
    clean_tables = torch.zeros(len(spans), width, dtype=torch.long)
    tables = torch.full((len(spans), width), trash, dtype=torch.long)
    at = 0
    for b, n in enumerate(num_blocks):
        clean_tables[b, :n] = torch.tensor(ids[at : at + n], dtype=torch.long)
        tables[b, :n] = clean_tables[b, :n]
        lo = spans[b][0]
        tables[b, : lo // bs] = trash  # freed: wholly outside the window
        at += n
    shape = (2, pool_size, bs, num_kv_heads, head_dim)
    clean = torch.randn(shape, generator=gen).to(dtype)
    poisoned = torch.empty_like(clean)
    flat = poisoned.view(2, pool_size * bs, num_kv_heads, head_dim)
    codes = torch.randint(0, len(POISONS), (pool_size * bs,), generator=gen)
    for i, value in enumerate(POISONS):
        flat[:, codes == i] = value
    for b, (lo, hi, _) in enumerate(spans):
        pos = torch.arange(lo, hi)
        slots = clean_tables[b, pos // bs] * bs + pos % bs
        flat[:, slots] = clean.view(2, pool_size * bs, num_kv_heads, head_dim)[:, slots]
    return Pool(
        clean=clean.to(device),
        poisoned=poisoned.to(device),
        block_tables=tables.to(device),
        clean_tables=clean_tables.to(device),
        readable=[(lo, hi) for lo, hi, _ in spans],
    )


@_one_thread()
def queries(rows: int, num_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """N(0, 1) queries; every third head peaky (x 6: logits of ~6 sigma), stressing the running max."""
    q = torch.randn(rows, num_heads, head_dim, generator=gen)
    q[:, ::3] *= 6.0
    return q.to(dtype)


def mixed_lengths(count: int, block_size: int, longest: int, rng: random.Random) -> list[int]:
    """Context lengths as a batch mixes them: 1, block edges +-1, short, long, and one `longest`."""
    edges = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1]
    out = [longest]
    while len(out) < count:
        out.append(rng.choice(edges) if rng.random() < 0.5 else rng.randint(1, longest))
    rng.shuffle(out)
    return out


@dataclass
class DecodeCase:
    q: Tensor  # [T, H, D] (T > B when rows is set)
    pool: Pool
    seq_lens: Tensor  # [B]
    rows: Tensor | None  # [B]
    window: int | None
    dtype: torch.dtype
    scale: float = field(init=False)

    def __post_init__(self) -> None:
        self.scale = self.q.shape[-1] ** -0.5


def decode_case(
    seq_lens: list[int],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    with_rows: bool = False,
    seed: int = 0,
    device: str = "cpu",
) -> DecodeCase:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    spans = [(0 if window is None else max(0, n - window), n, n) for n in seq_lens]
    pool = make_pool(spans, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=dtype, rng=rng, gen=gen, device=device)  # fmt: skip
    num = len(seq_lens)
    rows = None
    num_rows = num
    if with_rows:  # decodes scattered among other rows, in no particular order
        num_rows = 2 * num + 1
        rows = torch.tensor(rng.sample(range(num_rows), num), dtype=torch.long, device=device)
    q = queries(num_rows, num_kv_heads * group, head_dim, dtype, gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
    return DecodeCase(q, pool, lens, rows, window, dtype)


@dataclass
class PrefillCase:
    q: Tensor  # [T, H, D]
    k: Tensor  # [T, KVH, D]
    v: Tensor
    pool: Pool
    query_starts: Tensor  # [N]
    query_lens: Tensor
    seq_lens: Tensor
    window: int | None
    dtype: torch.dtype
    scale: float = field(init=False)

    def __post_init__(self) -> None:
        self.scale = self.q.shape[-1] ** -0.5

    @property
    def chunk_rows(self) -> Tensor:
        """Rows of q that belong to some chunk (the others must stay untouched in out)."""
        mask = torch.zeros(self.q.shape[0], dtype=torch.bool, device=self.q.device)
        for s, m in zip(self.query_starts.tolist(), self.query_lens.tolist(), strict=True):
            mask[s : s + m] = True
        return mask


def prefill_case(
    chunks: list[tuple[int, int]],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> PrefillCase:
    """chunks[n] = (context_len, query_len); chunks sit in q in order, one unused row between each."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    # readable: the cached prefix the first query may see; the chunk's own positions stay poisoned in
    # the cache (the kernel reads them from k/v)
    spans = [(0 if window is None else max(0, c - window + 1), c, c + m) for c, m in chunks]
    pool = make_pool(spans, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=dtype, rng=rng, gen=gen, device=device)  # fmt: skip
    starts, at = [], 1
    for _, m in chunks:
        starts.append(at)
        at += m + 1
    num_heads = num_kv_heads * group
    q = queries(at, num_heads, head_dim, dtype, gen)
    k = torch.randn(at, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(at, num_kv_heads, head_dim, generator=gen).to(dtype)
    as_index = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PrefillCase(
        q.to(device), k.to(device), v.to(device), pool, as_index(starts), as_index([m for _, m in chunks]),
        as_index([c + m for c, m in chunks]), window, dtype,
    )  # fmt: skip


@pytest.fixture
def one_thread() -> Iterator[None]:
    """For the attention test modules (autouse there): torch on one thread. Two threads of a loaded
    2-core machine run these small ops up to 100x slower (OpenMP waits), and no result depends on it."""
    with _one_thread():
        yield


def _attend64(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """One query token, float64: q [H, D], keys/values [L, KVH, D] -> [H, D]; zeros when L == 0.
    Head h reads KV head h // G. Elementwise products and sums (small float64 matmuls crawl on CPU)."""
    num_heads, num_kv_heads = q.shape[0], keys.shape[1]
    if keys.shape[0] == 0:
        return torch.zeros_like(q)
    kv_of_head = torch.arange(num_heads, device=q.device) // (num_heads // num_kv_heads)
    keys, values = keys[:, kv_of_head].transpose(0, 1), values[:, kv_of_head].transpose(0, 1)  # [H, L, D]
    probs = torch.softmax((keys * q[:, None, :]).sum(-1) * scale, dim=-1)  # [H, L]
    return (probs[..., None] * values).sum(1)


@_one_thread()
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
        out[b] = _attend64(q[rows[b]], cache[0, blocks, offsets], cache[1, blocks, offsets], case.scale)
    return out


@_one_thread()
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
            out[start + i] = _attend64(q[start + i], keys, values, case.scale)
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
        rows=case.rows, backend=backend, **kwargs,
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
        scale=case.scale, sliding_window=case.window, out=out, backend=backend, **kwargs,
    )  # fmt: skip
    return out


def check_decode(case: DecodeCase, backend: str, **kwargs) -> None:
    """Matches the oracle, and the poisoned pool gives bit-identical rows (issue #12)."""
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


# --- the oracle against the engine's torch path ------------------------------------------------------


def _engine_attend(q: Tensor, k: Tensor, v: Tensor, cache: Tensor, meta, scale: float) -> Tensor:
    from base_engine.attention import attend

    return attend(q, k, v, cache, meta, scale)


@pytest.mark.parametrize("window", [None, 20])
def test_decode_oracle_matches_engine_torch_path(window: int | None) -> None:
    from base_engine.attention import AttentionMetadata, build_decode_buckets

    case = decode_case([37, 1, 16, 70, 5], window=window, seed=1)
    tables = [row[row != 0].tolist() for row in case.pool.clean_tables]  # block 0: nobody's
    cache = case.pool.clean.clone()
    cache[:, 0] = 0  # the engine pads short rows of a bucket with a zero "null block"
    extra = {"null_block": 0} if "null_block" in inspect.signature(build_decode_buckets).parameters else {}
    buckets = build_decode_buckets(
        list(range(5)), tables, case.seq_lens.tolist(), block_size=16, sliding_window=window,
        dtype=torch.float32, **extra,
    )  # fmt: skip
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), buckets, [])
    got = _engine_attend(case.q, case.q, case.q, cache, meta, case.scale)
    assert_close(got, decode_oracle(case), torch.float32)


@pytest.mark.parametrize("window", [None, 24])
def test_prefill_oracle_matches_engine_torch_path(window: int | None) -> None:
    from base_engine.attention import AttentionMetadata, PrefillChunk, chunk_mask, write_kv

    case = prefill_case([(0, 9), (40, 17), (33, 1)], window=window, seed=2)
    cache = case.pool.clean.clone()
    bs = case.pool.block_size
    chunks, slots = [], []
    for n, (start, m, seq_len) in enumerate(
        zip(case.query_starts.tolist(), case.query_lens.tolist(), case.seq_lens.tolist(), strict=True)
    ):
        table = case.pool.clean_tables[n, : -(-seq_len // bs)]
        ctx = seq_len - m
        chunks.append(PrefillChunk(start, m, ctx, table, chunk_mask(ctx, m, window)))
        slots += [int(table[p // bs]) * bs + p % bs for p in range(ctx, seq_len)]
    rows = case.chunk_rows
    # the engine writes the chunk's own K/V to the cache first, then reads the prefix from it
    write_kv(cache, case.k[rows], case.v[rows], torch.tensor(slots, dtype=torch.long))
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), [], chunks)
    got = _engine_attend(case.q, case.k, case.v, cache, meta, case.scale)
    assert_close(got[rows], prefill_oracle(case)[rows], torch.float32)


def test_poisoned_pool_keeps_readable_slots_and_poisons_the_rest() -> None:
    case = decode_case([40, 3], window=8, seed=3)
    pool = case.pool
    flat = pool.poisoned[0].flatten(0, 1)
    readable = torch.zeros(flat.shape[0], dtype=torch.bool)
    for b, (lo, hi) in enumerate(pool.readable):
        for p in range(lo, hi):
            readable[int(pool.clean_tables[b, p // 16]) * 16 + p % 16] = True
    assert torch.equal(flat[readable], pool.clean[0].flatten(0, 1)[readable])
    assert not torch.isfinite(flat[~readable]).any()
    assert readable.sum() == 8 + 3
    assert (pool.block_tables[0, :2] != pool.clean_tables[0, :2]).all()  # blocks 0, 1 of seq 0: freed
    assert torch.equal(pool.block_tables[0, 2:], pool.clean_tables[0, 2:])
