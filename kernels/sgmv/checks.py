"""Argument checks for the SGMV ops, done once per call at the Python boundary (never inside kernels).

Every failure is a ValueError that names the argument, the value it got and what was expected.
Nothing here reads device memory when the caller passes a prebuilt `SgmvMeta` (see `slot_params`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.sgmv.meta import INT_DTYPES, SgmvMeta

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LoraLayout:
    """Shapes shared by all slices of one projection's stacked LoRA weights."""

    num_slices: int  # S
    num_slots: int  # N
    max_rank: int  # R_max
    hidden_in: int  # H_in (0 when only lora_b was checked)
    out_sizes: tuple[int, ...]  # H_out_s per slice (empty when only lora_a was checked)

    @property
    def out_offsets(self) -> tuple[int, ...]:
        # sizes [4096, 1024, 1024] -> offsets [0, 4096, 5120]
        offsets, total = [], 0
        for size in self.out_sizes:
            offsets.append(total)
            total += size
        return tuple(offsets)


@dataclass(frozen=True, eq=False)
class SlotParams:
    """Per (slice, slot) scale and rank, broadcast to [S, N] on the kernels' device."""

    scales: Tensor  # [S, N] float32 (possibly an expanded view of [N])
    ranks: Tensor  # [S, N] int32
    ranks_host: tuple[tuple[int, ...], ...] | None  # [S][N], when known without a device read
    scales_host: tuple[tuple[float, ...], ...] | None  # [S][N], when the scales were given on the host


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def _weight_list(name: str, weights: Sequence[Tensor]) -> list[Tensor]:
    if isinstance(weights, Tensor) or not isinstance(weights, Sequence) or len(weights) == 0:
        raise ValueError(
            f"{name} must be a non-empty list of 3-D tensors (one per slice), got {_shape(weights)}"
        )
    for s, w in enumerate(weights):
        if not isinstance(w, Tensor) or w.dim() != 3:
            raise ValueError(f"{name}[{s}] must be a 3-D tensor, got {_shape(w)}")
    return list(weights)


def check_lora_a(lora_a: Sequence[Tensor]) -> LoraLayout:
    """lora_a[s]: [N, R_max, H_in], all slices alike."""
    weights = _weight_list("lora_a", lora_a)
    first = tuple(weights[0].shape)
    for s, w in enumerate(weights):
        if tuple(w.shape) != first:
            raise ValueError(f"lora_a[{s}] has shape {tuple(w.shape)}, expected {first} like lora_a[0]")
    return LoraLayout(len(weights), first[0], first[1], first[2], ())


def check_lora_b_alone(lora_b: Sequence[Tensor]) -> LoraLayout:
    """lora_b[s]: [N, H_out_s, R_max] with N and R_max taken from lora_b[0] (hidden_in unknown: 0)."""
    weights = _weight_list("lora_b", lora_b)
    num_slots, max_rank = int(weights[0].shape[0]), int(weights[0].shape[2])
    out_sizes = check_lora_b(weights, len(weights), num_slots, max_rank)
    return LoraLayout(len(weights), num_slots, max_rank, 0, out_sizes)


def check_lora_b(lora_b: Sequence[Tensor], num_slices: int, num_slots: int, max_rank: int) -> tuple[int, ...]:
    """lora_b[s]: [N, H_out_s, R_max]; returns the H_out_s."""
    weights = _weight_list("lora_b", lora_b)
    if len(weights) != num_slices:
        raise ValueError(f"lora_b has {len(weights)} slices, expected {num_slices} like lora_a")
    for s, w in enumerate(weights):
        if w.shape[0] != num_slots or w.shape[2] != max_rank:
            raise ValueError(
                f"lora_b[{s}] has shape {tuple(w.shape)}, expected [{num_slots}, H_out, {max_rank}]"
            )
    return tuple(int(w.shape[1]) for w in weights)


def check_tensors(named: dict[str, Tensor], device: torch.device, dtype: torch.dtype, like: str) -> None:
    """All on `device` with `dtype` (that of the tensor named `like`, one of fp16/bf16/fp32)."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{like} has dtype {dtype}, expected one of {FLOAT_DTYPES}")
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like {like}")
        if t.dtype != dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} like {like}")


def check_matrix(name: str, t: Tensor, rows: int | None, cols: int) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {_shape(t)}")
    if (rows is not None and t.shape[0] != rows) or t.shape[1] != cols:
        want = f"[{'T' if rows is None else rows}, {cols}]"
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")


def check_meta(meta: SgmvMeta, num_tokens: int, num_slots: int, device: torch.device) -> None:
    """A prebuilt meta must describe this batch; its contents are trusted (checked when it was built)."""
    if not isinstance(meta, SgmvMeta):
        raise ValueError(f"meta must be an SgmvMeta from build_meta, got {type(meta).__name__}")
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta was built for {meta.num_tokens} tokens, this batch has T={num_tokens}")
    if meta.num_slots != num_slots:
        raise ValueError(f"meta was built for {meta.num_slots} slots, the weights have N={num_slots}")
    if meta.device != device:
        raise ValueError(f"meta lives on {meta.device}, expected {device} like x")


def _per_slot(name: str, t: Tensor, layout: LoraLayout, dtypes: tuple[torch.dtype, ...]) -> Tensor:
    """[N] or [S, N] -> an [S, N] view."""
    s, n = layout.num_slices, layout.num_slots
    if not isinstance(t, Tensor) or tuple(t.shape) not in ((n,), (s, n)):
        raise ValueError(f"{name} has shape {_shape(t)}, expected [{n}] or [{s}, {n}] (N slots, S slices)")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {dtypes}")
    return t.expand(s, n)


def _memo_host(t: Tensor, key: tuple, convert: Callable[[], tuple]) -> tuple:
    """convert(), memoised on the tensor t until t (or its storage, through any view) is next modified.

    The engine passes the same slot-pool scales/ranks tensors at every layer of every step and changes
    them only when an adapter is written into a slot; their version counter tells when that happened.
    """
    try:
        version = t._version
    except RuntimeError:  # inference-mode tensors carry no version counter: no memo
        return convert()
    memo = getattr(t, "_sgmv_host_memo", None)
    if memo is not None and memo[0] == version and memo[1] == key:
        return memo[2]
    value = convert()
    t._sgmv_host_memo = (version, key, value)
    return value


def slot_params(
    scales: Tensor, ranks: Tensor | None, layout: LoraLayout, device: torch.device, *, may_sync: bool
) -> SlotParams:
    """Broadcast scales/ranks to [S, N] on `device`; check 0 <= rank <= R_max where that costs no sync.

    Ranks held on the host (or any ranks when `may_sync`, i.e. no prebuilt meta) are checked here;
    device-resident ranks with a prebuilt meta are not read back: the kernels clamp them to R_max.
    """
    scales_2d = _per_slot(
        "scales", scales, layout, (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    )
    key = (layout.num_slices, layout.num_slots, layout.max_rank)
    scales_host = None
    if scales.device.type == "cpu":
        scales_host = _memo_host(scales, key, lambda: tuple(tuple(row) for row in scales_2d.float().tolist()))
    scales_2d = scales_2d.to(device=device, dtype=torch.float32)
    if ranks is None:
        full = torch.full(
            (layout.num_slices, layout.num_slots), layout.max_rank, dtype=torch.int32, device=device
        )
        host = tuple((layout.max_rank,) * layout.num_slots for _ in range(layout.num_slices))
        return SlotParams(scales_2d, full, host, scales_host)
    ranks_2d = _per_slot("ranks", ranks, layout, INT_DTYPES)
    host = None
    if ranks_2d.device.type == "cpu" or may_sync:
        host = _memo_host(ranks, key, lambda: _checked_ranks(ranks_2d, ranks.dim(), layout.max_rank))
    return SlotParams(scales_2d, ranks_2d.to(device=device, dtype=torch.int32), host, scales_host)


def _checked_ranks(ranks_2d: Tensor, given_dims: int, max_rank: int) -> tuple[tuple[int, ...], ...]:
    host = tuple(tuple(row) for row in ranks_2d.tolist())
    for s, row in enumerate(host):
        for slot, rank in enumerate(row):
            if not 0 <= rank <= max_rank:
                where = f"{s}, {slot}" if given_dims == 2 else f"{slot}"
                raise ValueError(f"ranks[{where}] = {rank}: expected 0 <= rank <= R_max={max_rank}")
    return host


def check_out_vectors(
    out_scale: Tensor | None, out_shift: Tensor | None, num_slots: int, width: int, device: torch.device
) -> None:
    """out_scale (and out_shift, which needs out_scale): float32 [N, sum(H_out_s)] on `device`."""
    if out_scale is None:
        if out_shift is not None:
            raise ValueError("out_shift was given without out_scale; expected both or out_scale alone")
        return
    for name, t in (("out_scale", out_scale), ("out_shift", out_shift)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or tuple(t.shape) != (num_slots, width):
            raise ValueError(
                f"{name} has shape {_shape(t)}, expected [N, sum(H_out)] = [{num_slots}, {width}]"
            )
        if t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, expected torch.float32 on {device}")
