"""Rotary position embeddings (Su et al. 2021, "RoFormer") in Hugging Face's rotate-half layout.

Frequencies for the scaling variants published checkpoints use: linear position interpolation
(Chen et al. 2023), Llama 3.1's band-wise "llama3" scaling (Meta, Llama 3 herd paper / reference code)
and YaRN (Peng et al. 2023, arXiv:2309.00071). All are fixed at load time; each is computed with the
same float32 operations `transformers` uses, so the rotations agree to float rounding.
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


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim // 2], attention_scaling); cos and sin get multiplied by the scaling."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be a positive even number")
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    inv_freq = _default_inv_freq(rope.theta, head_dim)
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
    """Rotate q or k: x [T, heads, head_dim]; cos, sin [T, head_dim] -> [T, heads, head_dim] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return x * cos.unsqueeze(1).to(x.dtype) + rotated * sin.unsqueeze(1).to(x.dtype)


class RopeCache:
    """cos/sin rows for positions [0, max_positions), computed once and grown on demand."""

    def __init__(self, rope: RopeConfig, head_dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq, self.scaling = rope_inv_freq(rope, head_dim)
        self.inv_freq = self.inv_freq.to(device)
        self.dtype = dtype
        self.device = device
        self.cos = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def __call__(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin each [num_tokens, head_dim] in the cache dtype for int64 `positions`.

        `max_position` (known on the host) spares reading positions back from the device.
        """
        if max_position is None:
            max_position = int(positions.max().item()) if positions.numel() else -1
        needed = max_position + 1
        if needed > self.cos.shape[0]:
            # Double to amortise growth; compute in float32, then cast once.
            size = max(needed, 2 * self.cos.shape[0], 256)
            all_positions = torch.arange(size, dtype=torch.int64, device=self.device)
            cos, sin = rope_cos_sin(self.inv_freq, all_positions, self.scaling)
            self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)
        return self.cos[positions], self.sin[positions]
