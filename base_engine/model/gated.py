"""The gated activation of an MLP (`act(gate) * up`), on the CPU in pieces below ATen's grain size.

ATen runs an elementwise op on more than 32768 elements (`at::internal::GRAIN_SIZE`) as an OpenMP
parallel region, whose join waits for every intra-op thread. On cores shared with other work one
descheduled thread stalls that join for a time slice, however little work the region held: a decode
step at batch 32 (32 x 1408 elements on bench-small) paid two such regions per layer. Up to
`MAX_PIECES` row pieces, each at most the grain size, run on the calling thread instead; bigger
tensors (prefill) stay one parallel op each.

Same bits: ATen's element-wise loops run whole SIMD vectors (two of them per iteration, up to 64
elements in bf16 on AVX-512) and a tail through a scalar path that may round differently (GELU-tanh
does). Pieces are whole rows, so only rows that are whole vectors (`width % VECTOR_ALIGN == 0`: 1408,
1536, ...) take this path; there every element runs the vector code, as in a one-op call whose
threads split the rows at vector boundaries (two threads on an even batch; one thread always).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: ops on more elements than this run in parallel
MAX_PIECES = 4  # beyond this many pieces the threads' share of the work is worth a join
VECTOR_ALIGN = 64  # row widths split into pieces: whole unrolled SIMD vectors in every dtype


def _act(gate: torch.Tensor, gelu: bool) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)


def gated(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """`act(gate) * up` for [T, I] gate and up (SiLU, or GELU-tanh for GeGLU)."""
    rows, width = gate.shape[0], gate.shape[-1]
    per_piece = GRAIN_SIZE // max(1, width)
    small = gate.numel() <= GRAIN_SIZE or rows > per_piece * MAX_PIECES
    if gate.device.type != "cpu" or small or per_piece == 0 or width % VECTOR_ALIGN:
        return _act(gate, gelu) * up
    out = torch.empty_like(up)
    for start in range(0, rows, per_piece):
        piece = slice(start, start + per_piece)
        torch.mul(_act(gate[piece], gelu), up[piece], out=out[piece])
    return out
