"""Rotary position embeddings (Su et al. 2021, "RoFormer") in Hugging Face's rotate-half layout.

Frequencies for the scaling variants published checkpoints use: linear position interpolation
(Chen et al. 2023), Llama 3.1's band-wise "llama3" scaling (Meta, Llama 3 herd paper / reference code),
YaRN (Peng et al. 2023, arXiv:2309.00071) and Phi-3's LongRoPE (Ding et al. 2024, arXiv:2402.13753), whose
short and long factor sets are both fixed at load time (the scheduler picks one per sequence); partial
rotary rotates only a head's leading dims. Each is computed with the same float32 operations
`transformers` uses, so the rotations agree to float rounding.
"""

from __future__ import annotations

import math

import torch

from base_engine.model.config import RopeConfig


def _default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    # inv_freq[i] = theta^(-2i/d), i in [0, d/2)   # [head_dim // 2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Low frequencies (long wavelengths) slowed by `factor`, high ones kept, a linear blend between."""
    assert rope.original_max_position_embeddings is not None  # checked by RopeConfig
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor  # longer than this: scaled by 1/factor
    high_freq_wavelen = old_context / rope.high_freq_factor  # shorter than this: unchanged
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    # smooth goes 0 -> 1 as the wavelength shrinks from low_freq_wavelen to high_freq_wavelen.
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the dimensions that rotate few times over the old context, keep fast ones."""
    assert rope.original_max_position_embeddings is not None  # checked by RopeConfig
    extra = rope.extra
    attention_factor = extra.get("attention_factor")
    mscale, mscale_all_dim = extra.get("mscale"), extra.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(rope.factor, mscale) / _yarn_mscale(rope.factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(rope.factor)
    beta_fast = extra.get("beta_fast") or 32
    beta_slow = extra.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        old_context = rope.original_max_position_embeddings
        return head_dim * math.log(old_context / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if extra.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation_weight = 1 - ramp  # 1 for fast dimensions (kept), 0 for slow ones (interpolated)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim)
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(rope: RopeConfig, rotary_dim: int, long: bool) -> torch.Tensor:
    """Each default frequency divided by its short (or long) factor."""
    factors = rope.long_factor if long else rope.short_factor
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors; expected rotary_dim / 2 = {rotary_dim // 2}")
    ext_factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (ext_factors * rope.theta**exponents)


def rope_inv_freq(rope: RopeConfig, head_dim: int, *, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [rotary_dim // 2], attention_scaling); cos and sin get multiplied by the scaling.

    rotary_dim is head_dim unless the rotation is partial. long: LongRoPE's long factor set.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be a positive even number")
    rotary_dim = rope.rotary_dim(head_dim)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim} (head_dim {head_dim}) must be a positive even number")
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(rope, rotary_dim, long), rope.attention_factor
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    inv_freq = _default_inv_freq(rope.theta, rotary_dim)
    if rope.rope_type == "linear":
        # Dividing frequencies by `factor` equals dividing positions by it (position interpolation).
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq), 1.0
    if rope.rope_type == "default":
        return inv_freq, 1.0
    raise ValueError(f"rope_type {rope.rope_type!r} has no frequency rule here")


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin each [num_tokens, head_dim] float32, the two halves repeated (rotate-half layout).

    positions [num_tokens] int64, e.g. [0, 1, 2, 0, 1] for two sequences of 3 and 2 tokens.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k: x [T, heads, head_dim]; cos, sin [T, rotary_dim] -> [T, heads, head_dim] in x's dtype.

    Partial rotary (rotary_dim < head_dim): the first rotary_dim dims rotate, the rest pass through.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return x * cos.unsqueeze(1).to(x.dtype) + rotated * sin.unsqueeze(1).to(x.dtype)


class RopeCache:
    """cos/sin rows for positions [0, max_positions), computed once and grown on demand.

    LongRoPE: one fixed table of 2 * max_positions rows, row p with the short factors and row
    `long_offset + p` with the long ones (`row_offset` says which half a sequence reads).
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int = 0,
    ) -> None:
        self.inv_freq, self.scaling = rope_inv_freq(rope, head_dim)
        self.inv_freq = self.inv_freq.to(device)
        self.dtype = dtype
        self.device = device
        rotary_dim = rope.rotary_dim(head_dim)
        self.cos = torch.empty(0, rotary_dim, dtype=dtype, device=device)
        self.sin = torch.empty(0, rotary_dim, dtype=dtype, device=device)
        self.long_offset = 0
        if rope.rope_type == "longrope":
            if max_positions <= 0:
                raise ValueError(f"longrope needs the table size; got max_positions={max_positions}")
            self.long_offset = max_positions
            long_inv_freq, _ = rope_inv_freq(rope, head_dim, long=True)
            all_positions = torch.arange(max_positions, dtype=torch.int64, device=device)
            short = rope_cos_sin(self.inv_freq, all_positions, self.scaling)
            long = rope_cos_sin(long_inv_freq.to(device), all_positions, self.scaling)
            self.cos = torch.cat((short[0], long[0])).to(dtype)
            self.sin = torch.cat((short[1], long[1])).to(dtype)

    def row_offset(self, is_long: bool) -> int:
        """What to add to a position to read its row: long_offset for a LongRoPE long-factor sequence."""
        return self.long_offset if is_long else 0

    def __call__(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin each [num_tokens, rotary_dim] in the cache dtype for int64 rows `positions`.

        `max_position` (known on the host) spares reading positions back from the device.
        """
        if max_position is None:
            max_position = int(positions.max().item()) if positions.numel() else -1
        needed = max_position + 1
        if self.long_offset and needed > self.cos.shape[0]:
            raise ValueError(f"row {max_position} is past the LongRoPE table of {self.cos.shape[0]} rows")
        if needed > self.cos.shape[0]:
            # Double to amortise growth; compute in float32, then cast once.
            size = max(needed, 2 * self.cos.shape[0], 256)
            all_positions = torch.arange(size, dtype=torch.int64, device=self.device)
            cos, sin = rope_cos_sin(self.inv_freq, all_positions, self.scaling)
            self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)
        return self.cos[positions], self.sin[positions]
