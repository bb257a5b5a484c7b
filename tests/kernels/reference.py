"""Float64 loop oracle for SGMV and the batch generators the kernel tests share.

Popularity shapes follow Punica's kernel tests (identical / distinct / uniform / skewed [1, T-1] /
Zipf 1.5), plus rows without an adapter; see ../shared/reference/kernels.md section 1.5.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.sgmv.layout import alloc_stacks

POPULARITIES = ("identical", "distinct", "uniform", "skewed", "zipf", "some_none", "all_none")
# relative and absolute tolerance per dtype (the bounds). bfloat16 (8 significant bits, unit
# roundoff u = 2^-9): y is rounded once (<= u |y|), the CPU schedules round the shrink's output v once
# (<= u |delta|, as PEFT in bf16 does) and sum in fp32 (FBGEMM bags, oneDNN GEMMs); with |y|, |delta|
# ~ 1 here that is ~2u-3u = 4e-3-6e-3, and 1.6e-2 (2^-6, four units) leaves room for the inputs'
# own rounding, which the float64 oracle reads exactly.
TOLERANCES = {torch.float32: 5e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_slots(
    popularity: str, num_tokens: int, num_slots: int, rng: random.Random, shuffle: bool = True
) -> list[int]:
    """Slot per row for one popularity shape; shuffled rows, or each adapter's rows in one run (prefill)."""
    t, n = num_tokens, num_slots
    pool = rng.sample(range(n), n)  # which slots are used, in random order
    if popularity == "identical":
        lens = [t]
    elif popularity == "distinct":
        lens = [1] * t  # cycles through the pool when t > n
    elif popularity == "uniform":
        groups = min(n, math.ceil(math.sqrt(t)))
        lens = [t // groups + (1 if i < t % groups else 0) for i in range(groups)]
    elif popularity == "skewed":
        lens = [1, t - 1] if t > 1 and n > 1 else [t]
    elif popularity == "zipf":
        lens, k = [], 0
        while sum(lens) < t:
            lens.append(min(math.floor(1.5**k), t - sum(lens)))
            k += 1
        lens.sort(reverse=True)
    elif popularity == "some_none":
        slots = [rng.randrange(n) if rng.random() < 0.6 else -1 for _ in range(t)]
        return slots
    elif popularity == "all_none":
        return [-1] * t
    else:
        raise ValueError(f"unknown popularity {popularity!r}")
    slots = [pool[g % n] for g, length in enumerate(lens) for _ in range(length)]
    if shuffle:
        rng.shuffle(slots)
    return slots


@dataclass
class Case:
    """One add_lora call's inputs: weights hold NaN in unused slots and beyond each slot's rank."""

    x: Tensor  # [T, H_in]
    y: Tensor  # [T, sum(H_out_s)], a strided view into `buf`
    buf: Tensor  # y's storage with guard rows and columns around it
    lora_a: list[Tensor]
    lora_b: list[Tensor]
    token_slots: Tensor
    scales: Tensor  # [S, N] or [N]
    ranks: Tensor  # [S, N] or [N]


def make_case(
    *,
    num_tokens: int,
    hidden_in: int,
    out_sizes: tuple[int, ...],
    num_slots: int,
    max_rank: int,
    popularity: str,
    dtype: torch.dtype,
    seed: int,
    mixed_ranks: bool = True,
    per_slice: bool = True,
    shuffle: bool = True,
    device: str | torch.device = "cpu",
) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    s_count, n = len(out_sizes), num_slots
    slots = make_slots(popularity, num_tokens, n, rng, shuffle)
    rank_shape = (s_count, n) if per_slice else (n,)
    if mixed_ranks:
        ranks = torch.randint(1, max_rank + 1, rank_shape, generator=gen, device=device)
    else:
        ranks = torch.full(rank_shape, max_rank, device=device)
    ranks_2d = ranks.expand(s_count, n)
    scales = torch.rand(rank_shape, generator=gen, device=device) + 0.25
    unused = torch.ones(n, dtype=torch.bool, device=device)
    unused[[a for a in set(slots) if a >= 0]] = False
    lora_a, lora_b = [], []
    for s, h_out in enumerate(out_sizes):
        a = torch.randn(n, max_rank, hidden_in, generator=gen, device=device) / math.sqrt(hidden_in)
        b = torch.randn(n, h_out, max_rank, generator=gen, device=device) / math.sqrt(max_rank)
        # NaN in unused slots and beyond each slot's rank: reading any of it would show in the output
        beyond = torch.arange(max_rank, device=device)[None, :] >= ranks_2d[s][:, None]  # [N, R]
        a.masked_fill_(beyond[:, :, None] | unused[:, None, None], math.nan)
        b.masked_fill_(beyond[:, None, :] | unused[:, None, None], math.nan)
        lora_a.append(a.to(dtype))
        lora_b.append(b.to(dtype))
    x_buf = torch.randn(num_tokens, hidden_in + 3, generator=gen, device=device).to(dtype)
    width = sum(out_sizes)
    buf = torch.randn(num_tokens + 2, width + 5, generator=gen, device=device).to(dtype)
    return Case(
        x=x_buf[:, 1 : hidden_in + 1],  # strided view: row stride hidden_in + 3
        y=buf[1 : num_tokens + 1, 2 : width + 2],  # guard rows and columns around it
        buf=buf,
        lora_a=lora_a,
        lora_b=lora_b,
        token_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        scales=scales,
        ranks=ranks,
    )


def reference_delta(case: Case) -> Tensor:
    """float64 [T, sum(H_out_s)]: the per-row loop of the Semantics block."""
    s_count = len(case.lora_a)
    n = case.lora_a[0].shape[0]
    scales = case.scales.double().expand(s_count, n)
    ranks = case.ranks.expand(s_count, n)
    x = case.x.double()
    delta = torch.zeros(case.y.shape, dtype=torch.float64)
    for t, a in enumerate(case.token_slots.tolist()):
        if a < 0:
            continue
        off = 0
        for s, (la, lb) in enumerate(zip(case.lora_a, case.lora_b, strict=True)):
            r, h_out = int(ranks[s, a]), lb.shape[1]
            w_a = la[a, :r].double()  # [r, H_in]
            w_b = lb[a, :, :r].double()  # [H_out, r]
            delta[t, off : off + h_out] += scales[s, a] * ((x[t] @ w_a.T) @ w_b.T)
            off += h_out
    return delta


def bits(t: Tensor) -> Tensor:
    """Raw bit pattern, so NaN and -0.0 compare exactly."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def reference_delta_by_slot(case: Case) -> Tensor:
    """float64 [T, sum(H_out_s)] computed per distinct slot (rows masked by slot), for large shapes."""
    s_count = len(case.lora_a)
    n = case.lora_a[0].shape[0]
    scales = case.scales.double().expand(s_count, n).tolist()
    ranks = case.ranks.expand(s_count, n).tolist()
    x = case.x.double()
    delta = torch.zeros(case.y.shape, dtype=torch.float64, device=case.y.device)
    for a in sorted(set(case.token_slots.tolist()) - {-1}):
        rows = torch.nonzero(case.token_slots == a).flatten()
        off = 0
        for s, (la, lb) in enumerate(zip(case.lora_a, case.lora_b, strict=True)):
            r, h_out = ranks[s][a], lb.shape[1]
            v = x[rows] @ la[a, :r].double().T  # [rows, r]
            delta[rows, off : off + h_out] = scales[s][a] * (v @ lb[a, :, :r].double().T)
            off += h_out
    return delta


def expected_output(
    case: Case, *, by_slot: bool = False, out_scale: Tensor | None = None, out_shift: Tensor | None = None
) -> Tensor:
    """float64 value y must hold after the call; with out_scale (DoRA) each row with an adapter is
    then out_scale[a] * (y + delta) + out_shift[a], per output column."""
    delta = reference_delta_by_slot(case) if by_slot else reference_delta(case)
    out = case.y.double() + delta
    if out_scale is not None:
        for t, a in enumerate(case.token_slots.tolist()):
            if a >= 0:
                out[t] = out[t] * out_scale[a].double()
                if out_shift is not None:
                    out[t] += out_shift[a].double()
    return out


def make_out_vectors(case: Case, *, seed: int, with_shift: bool) -> tuple[Tensor, Tensor | None]:
    """DoRA-like fp32 [N, sum(H_out)] vectors: odd slots rescaled (0.5-1.5) and shifted, even slots
    plain LoRA (exactly 1 and 0: their rows must equal a call without vectors)."""
    gen = torch.Generator().manual_seed(seed)
    n, width = case.lora_a[0].shape[0], case.y.shape[1]
    scale = torch.rand(n, width, generator=gen) + 0.5
    shift = torch.randn(n, width, generator=gen) * 0.1
    scale[0::2], shift[0::2] = 1.0, 0.0
    device = case.y.device
    return scale.to(device), shift.to(device) if with_shift else None


def changeable(case: Case) -> Tensor:
    """bool mask over case.buf: True only at y's rows that have an adapter (all else must keep its bits)."""
    mask = torch.zeros(case.buf.shape, dtype=torch.bool, device=case.buf.device)
    rows = torch.zeros(case.y.shape[0], dtype=torch.bool, device=case.buf.device)
    rows[case.token_slots >= 0] = True
    # y is buf[1 : T + 1, 2 : W + 2] (see make_case)
    mask[1 : case.y.shape[0] + 1, 2 : case.y.shape[1] + 2] = rows[:, None]
    return mask


def assert_matches(case: Case, expected: Tensor, before: Tensor, dtype: torch.dtype) -> None:
    """Close to the float64 oracle; bit-identical outside the rows that have an adapter."""
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(case.y.double(), expected, rtol=tol, atol=tol)
    keep = ~changeable(case)
    assert torch.equal(bits(case.buf)[keep], bits(before)[keep]), "a -1 row or a guard row/column changed"


def run_add_lora(case: Case, backend: str, **kwargs: object) -> None:
    """add_lora on the case's own tensors (kwargs override token_slots / meta / ranks)."""
    from kernels.sgmv import add_lora

    args: dict = {"token_slots": case.token_slots, "scales": case.scales, "ranks": case.ranks, **kwargs}
    slots = args.pop("token_slots")
    add_lora(case.y, case.x, case.lora_a, case.lora_b, slots, backend=backend, **args)


def small_case(**overrides: object) -> Case:
    """A small fp32 case; any make_case argument can be overridden."""
    args: dict = dict(
        num_tokens=9, hidden_in=32, out_sizes=(16, 8), num_slots=4, max_rank=8,
        popularity="some_none", dtype=torch.float32, seed=0,
    )  # fmt: skip
    args.update(overrides)
    return make_case(**args)


def check_shrink(case: Case, v: torch.Tensor) -> None:
    """v[s, t] == scale * x[t] @ A[s][a, :r].T in float64; exactly zero at -1 rows and beyond r."""
    s_count, n, r_max = len(case.lora_a), case.lora_a[0].shape[0], case.lora_a[0].shape[1]
    assert v.dtype == torch.float32 and v.shape == (s_count, case.x.shape[0], r_max)
    ranks, scales = case.ranks.expand(s_count, n), case.scales.double().expand(s_count, n)
    for t, a in enumerate(case.token_slots.tolist()):
        for s in range(s_count):
            r = int(ranks[s, a]) if a >= 0 else 0
            assert not v[s, t, r:].any()
            if r:
                want = scales[s, a] * (case.x[t].double() @ case.lora_a[s][a, :r].double().T)
                torch.testing.assert_close(v[s, t, :r].double(), want, rtol=1e-5, atol=1e-5)


def poisoned(v: torch.Tensor) -> torch.Tensor:
    """v with NaN wherever the expand must not read (-1 rows, beyond each rank)."""
    out = v.clone()
    out[out == 0] = float("nan")
    return out


def case_id(cfg: dict) -> str:
    """Readable pytest id of a make_case config: popularity-dtype[-schedule]-shape."""
    dtype = str(cfg["dtype"]).removeprefix("torch.")
    sched = f"-{cfg['schedule']}" if "schedule" in cfg else ""
    slices = len(cfg["out_sizes"])
    shape = f"T{cfg['num_tokens']}-H{cfg['hidden_in']}-S{slices}-N{cfg['num_slots']}-r{cfg['max_rank']}"
    return f"{cfg['popularity']}-{dtype}{sched}-{shape}"


def check_rank_zero(backend: str) -> None:
    """Slot 0 has rank 0 in every slice, slot 1 only in slice 1 (a q/v adapter): all of it NaN, never read."""
    case = small_case(out_sizes=(16, 8, 8), popularity="uniform", num_tokens=12, mixed_ranks=False, seed=2)
    case.ranks[:, 0] = 0
    case.ranks[1, 1] = 0
    for w in case.lora_a + case.lora_b:
        w[0] = float("nan")
    case.lora_a[1][1] = float("nan")
    case.lora_b[1][1] = float("nan")
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, backend)
    assert_matches(case, expected, before, torch.float32)


def to_cpu_layout(case: Case) -> Case:
    """The same weights (NaN included) copied into the engine's CPU slot-pool layout."""
    n, r, h_in = case.lora_a[0].shape
    outs = tuple(b.shape[1] for b in case.lora_b)
    lora_a, lora_b = alloc_stacks(n, r, h_in, outs, dtype=case.lora_a[0].dtype, device=torch.device("cpu"))
    for dst, src in zip((*lora_a, *lora_b), (*case.lora_a, *case.lora_b), strict=True):
        dst.copy_(src)
    case.lora_a, case.lora_b = lora_a, lora_b
    return case
