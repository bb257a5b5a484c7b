"""Batch-invariant execution: a request's bits do not depend on what shares its steps.

A step that holds a `deterministic` request (or every step, with `EngineConfig.deterministic`) runs
kernels whose reduction order depends only on the row itself:
  * GEMMs (`invariant_linear`): a BLAS picks its blocking from the problem's shape, so the same row
    can be summed in another order when the batch has another number of rows. Measured on this
    build (torch 2.13 CPU, MKL, 2 threads): with K <= 512 a row's bits are the same for every M >= 16;
    with K = 1408 they change from M = 57 on (K is blocked differently). So rows are padded to at
    least 16 and K is cut into fixed 512-wide pieces summed in a fixed order: every M from 1 to 2100
    then gives the same bits; a projection narrower than 16 outputs (a gate's logit) is padded to 16
    zero columns, since MKL's narrow path sums a block's tail rows in another order
    (tests/base_engine/test_batch_invariance.py keeps that true end to end, and
    `check_gemm_invariance` probes the model's own shapes before the first such step).
  * attention: every query token, prefill or decode, attends alone to its own keys, padded to whole
    blocks of its own length and always masked (`attention.build_token_buckets`): SDPA on CPU gives a
    row the same bits whatever other rows share the call, but not for another query length, so a
    prompt token computed in a chunk of any size, a decode and a recomputed (preempted) token all
    take the same path.
  * LoRA: one schedule for every row, the per-row bag schedule (kernels/sgmv/torch_bag.py; in
    bfloat16 on float32 copies of the operands), never the per-adapter GEMM loop picked from the
    batch's composition.
  * norms, activations, sampling: row-wise already (per-row reductions; each deterministic request
    draws from its own seed: base_engine/seeded_uniform.py).
Only the CPU path is batch-invariant today: cuBLAS and the Triton kernels' split-K are not, so the
mode is refused elsewhere with that reason.
"""

from __future__ import annotations

import secrets
import threading

import torch
import torch.nn.functional as F

INVARIANT_MIN_ROWS = 16  # fewer rows than this take other BLAS paths (GEMV and small-M kernels)
INVARIANT_K_CHUNK = 512  # widest reduction one BLAS call makes in this mode
# Fewer output columns than this (Qwen2-MoE's shared-expert gate: N = 1) take a GEMV-like path whose
# last M mod 4 rows are summed in another order; padded with zero columns, they take the GEMM's.
INVARIANT_MIN_COLS = 16
# float32 (MKL) and bfloat16 (oneDNN, AMX / AVX512-BF16) GEMMs keep a row's bits under this construction
# on this build; `GemmProbe` checks it in the serving dtype on the machine itself. float16 is not probed.
INVARIANT_DTYPES = (torch.float32, torch.bfloat16)
# What a deterministic request's steps run, as provenance names kernels (base_engine/identity.py).
INVARIANT_LORA_KERNEL = "torch-bags-invariant"
INVARIANT_ATTENTION = "token-sdpa-invariant"


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with row bits independent of x's other rows and of their number.
    In bfloat16 each piece's output (accumulated in float32 inside the GEMM) is summed in float32 and
    rounded once, as the one unsplit bf16 GEMM rounds once."""
    rows, width = x.shape
    out_features = weight.shape[0]
    if rows < INVARIANT_MIN_ROWS:
        x = torch.cat([x, x.new_zeros(INVARIANT_MIN_ROWS - rows, width)])
    if out_features < INVARIANT_MIN_COLS:
        weight = torch.cat([weight, weight.new_zeros(INVARIANT_MIN_COLS - out_features, width)])
    y = F.linear(x[:, :INVARIANT_K_CHUNK], weight[:, :INVARIANT_K_CHUNK]).float()
    for start in range(INVARIANT_K_CHUNK, width, INVARIANT_K_CHUNK):
        y += F.linear(x[:, start : start + INVARIANT_K_CHUNK], weight[:, start : start + INVARIANT_K_CHUNK])
    if out_features < INVARIANT_MIN_COLS:
        y = y[:, :out_features]
    if bias is not None:
        y += bias
    y = y.to(x.dtype)
    return y[:rows] if rows < INVARIANT_MIN_ROWS else y


def unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this engine cannot run deterministic requests, or None when it can."""
    if device.type != "cpu":
        return (
            f"deterministic mode runs only on the CPU engine for now (this engine runs on {device.type}: "
            "its GEMM library and the Triton kernels' split reductions are not batch-invariant)"
        )
    if dtype not in INVARIANT_DTYPES:
        return f"deterministic mode needs dtype float32 or bfloat16 on the CPU (this engine runs {dtype})"
    return None


# Row counts the probe compares: GEMV (1, padded), small-M kernels, and the sizes where MKL changed
# its K blocking for K = 1408 (57..) and later again (200+, 1000+).
_PROBE_ROWS = (1, 16, 17, 57, 100, 257, 1000)


class GemmProbe:
    """Checks once, per distinct weight shape, that `invariant_linear` gives a row the same bits for
    every probed batch size on this machine's BLAS in `dtype`; remembers the first failure."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._lock = threading.Lock()
        self._checked: set[tuple[int, int]] = set()
        self.failure: str | None = None

    def check(self, shapes: set[tuple[int, int]]) -> str | None:
        """None when every (out_features, in_features) shape is batch-invariant, else the reason."""
        with self._lock:
            for shape in sorted(shapes - self._checked):
                if self.failure is None and not _shape_is_invariant(*shape, self.dtype):
                    self.failure = (
                        f"deterministic mode is not available on this machine: its BLAS does not give "
                        f"batch-invariant rows for a {shape[1]}x{shape[0]} projection in {self.dtype}"
                    )
                self._checked.add(shape)
            return self.failure


@torch.inference_mode()
def _shape_is_invariant(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(out_features * 7919 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen, device="cpu").to(dtype)
    row = torch.randn(in_features, generator=gen, device="cpu").to(dtype)
    reference = invariant_linear(row[None], weight)[0]
    for rows in _PROBE_ROWS[1:]:
        x = torch.randn(rows, in_features, generator=gen, device="cpu").to(dtype)
        for at in {(rows * 7) // 11, rows - 1}:  # inside the BLAS's row blocks and in their tail
            x[at] = row
            if not torch.equal(invariant_linear(x, weight)[at], reference):
                return False
    return True


def linear_shapes(model: torch.nn.Module, *, column_chunk: int) -> set[tuple[int, int]]:
    """(out_features, in_features) of the GEMMs the model makes: its Linears, wider ones (the LM head)
    in the `column_chunk`-wide pieces it computes them in."""
    shapes = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shapes.add((min(module.out_features, column_chunk), module.in_features))
    return shapes


class Determinism:
    """An engine's deterministic mode: every request (`always`, EngineConfig.deterministic) or those
    that ask (`SamplingParams.deterministic`); `refusal()` says why this engine cannot, if it cannot."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        *,
        always: bool,
        column_chunk: int,
    ) -> None:
        self.always = always
        self._reason = unsupported_reason(device, dtype)
        if self._reason is None and any(hasattr(m, "qweight") for m in model.modules()):
            self._reason = (
                "deterministic mode is not available with quantization int8 (its weight-only int8 GEMM "
                "is not probed batch-invariant); serve without --quantization for deterministic requests"
            )
        self._shapes = linear_shapes(model, column_chunk=column_chunk)
        # A bf16 CPU engine computes its logits in float32 (CausalLM.keep_float32_logits): both probed.
        self._probes = [GemmProbe(dtype)] + ([GemmProbe(torch.float32)] if dtype != torch.float32 else [])
        if always and (reason := self.refusal()) is not None:
            raise ValueError(reason)

    def refusal(self) -> str | None:
        """None when batch-invariant steps are available (the GEMM probe runs once, on first ask)."""
        if self._reason is not None:
            return self._reason
        return next((failure for probe in self._probes if (failure := probe.check(self._shapes))), None)

    def seed(self, seed: int | None) -> int:
        """A deterministic request's own seed: its own, else one drawn for it (never the engine's
        shared generator, whose draws would depend on the other requests of each step)."""
        return seed if seed is not None else secrets.randbits(63)
