"""Cases and the float64 oracle for the grouped MoE GEMM (test_moe_triton.py, test_moe_gpu.py).

A case is rows sorted by expert with a popularity pattern: uniform, skewed (one expert takes most rows),
zipf, empty (every other expert has no rows), one (a single expert), all_in_one (many experts, one has
every row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POPULARITIES = ("uniform", "skewed", "zipf", "empty", "one", "all_in_one")
TOLERANCES = {  # (rtol, atol per unit of the row's |x| . |w| scale); bf16: 2 ulps (the CPU interpreter
    # truncates fp32 -> bf16 where a GPU rounds to nearest)
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


@dataclass(frozen=True)
class MoeCase:
    x: torch.Tensor  # [M, K]
    w: torch.Tensor  # [E, N, K]
    offsets: torch.Tensor  # [E + 1] int64


def counts_for(popularity: str, num_rows: int, num_experts: int, gen: torch.Generator) -> list[int]:
    """Rows per expert, summing to num_rows."""
    if popularity == "one":
        return [num_rows]
    if popularity == "all_in_one":
        hot = int(torch.randint(num_experts, (1,), generator=gen))
        return [num_rows if e == hot else 0 for e in range(num_experts)]
    weights = {
        "uniform": torch.ones(num_experts),
        "skewed": torch.tensor([8.0] + [0.5] * (num_experts - 1)),
        "zipf": 1.0 / torch.arange(1, num_experts + 1).double() ** 1.2,
        "empty": torch.tensor([1.0 if e % 2 else 0.0 for e in range(num_experts)]),
    }[popularity]
    experts = torch.multinomial(weights.double(), num_rows, replacement=True, generator=gen)
    return torch.bincount(experts, minlength=num_experts).tolist()


def make_moe_case(
    popularity: str, num_rows: int, num_experts: int, n: int, k: int, dtype: torch.dtype, seed: int,
    device: str = "cpu",
) -> MoeCase:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    experts = 1 if popularity == "one" else num_experts
    counts = counts_for(popularity, num_rows, experts, torch.Generator().manual_seed(seed))
    offsets = torch.zeros(experts + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    x = torch.randn(num_rows, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(experts, n, k, generator=gen, device=device) / k**0.5).to(dtype)
    return MoeCase(x, w, offsets.to(device))


def _per_expert(x: torch.Tensor, w: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """float64 y[r] = x[r] @ w[e].T, one expert's segment at a time (on the tensors' device)."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for expert in range(w.shape[0]):
        start, end = bounds[expert], bounds[expert + 1]
        if start < end:
            out[start:end] = x[start:end].double() @ w[expert].double().T
    return out


def reference(case: MoeCase) -> torch.Tensor:
    """The float64 loop over experts."""
    return _per_expert(case.x, case.w, case.offsets.tolist())


def assert_close_to(out: torch.Tensor, want: torch.Tensor, case: MoeCase) -> None:
    """out within the dtype's tolerance of want, relative to each element's |x| . |w| scale and |want|."""
    tol = TOLERANCES[case.x.dtype]
    scale = _per_expert(case.x.abs(), case.w.abs(), case.offsets.tolist())
    err = (out.double() - want.double()).abs()
    bound = tol * (scale + want.abs().double())
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off; worst {float((err / (scale + 1e-30)).max()):.3g}"
