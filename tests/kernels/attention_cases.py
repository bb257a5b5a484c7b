"""Case generators for the paged attention kernel tests (kernels/attention): pools, queries, lengths.

Cases are "realistic": blocks scattered through the pool as the block manager leaves them, context
lengths mixed (1, block edges +-1, long ones), some query heads peaky (large logits, so the online
softmax's rescaling matters), sliding windows that free whole blocks. Every case comes twice: clean,
and poisoned, where each slot no row may read (beyond a length, before a window, the chunk's own
positions in the cache, spare blocks, table padding, freed blocks) holds NaN, +Inf or -Inf.
The float64 oracle they are checked against is in attention_oracle.py.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

POISONS = (float("nan"), float("inf"), float("-inf"))


@contextlib.contextmanager
def torch_on_one_thread() -> Iterator[None]:
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


@torch_on_one_thread()
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


@torch_on_one_thread()
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
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
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
    softcap: float | None = None,
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
    return DecodeCase(q, pool, lens, rows, window, dtype, softcap)


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
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
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
    softcap: float | None = None,
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
        as_index([c + m for c, m in chunks]), window, dtype, softcap,
    )  # fmt: skip
