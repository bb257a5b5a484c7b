"""The composed bound, checked at upload: what an adapter's deltas can do to a decoder layer where they
meet, not only one projection at a time (factors.check_delta_bound).

Every supported architecture (llama, mistral, qwen2) is pre-norm: each attention and MLP block reads
an RMS-normed copy of the residual stream, so, as in the per-projection check, the block inputs are
taken to satisfy |x_j| <= X = `max_activation(dtype)`, and so is every activation the base model makes
on its own (its weights are not known at upload). A projection's delta then adds at most
`gain * X_in` to its output for an input bounded by X_in, where
`gain = |scale| * max_i sum_k |B_ik| sum_j |A_kj|` (>= ||scale B A||_inf, from the factors without
forming B A). Per layer, with dP = gain_P * X for the projections that read the block input:

- attention logits: |q.k - q0.k0| * head_dim^-1/2 <= sqrt(head_dim) * (dQ (X + dK) + X dK)
  (RoPE rotates pairs of coordinates, so it keeps ||q||_2 <= sqrt(head_dim) |q|_inf);
- the MLP's product: |silu(g) u - silu(g0) u0| <= 1.1 dG (X + dU) + (X + 0.28) dU = dM
  (silu's slope is at most 1.1, and |silu(g0)| <= X + 0.28);
- what the layer adds to the residual stream through its own deltas: gain_o (X + dV) (attention's
  output is a convex combination of values) + gain_down (X + dM).

The logits must stay <= finfo(float32).max (attention kernels accumulate q.k and the softmax in fp32,
whatever the serving dtype); the MLP product and the layer's additions <= finfo(dtype).max; and the
additions summed over the layers <= sqrt(finfo(float32).max / hidden_size): past it the next
RMSNorm's fp32 mean of squares overflows, and the norm silently zeroes the layer's input instead of
failing. fp16 leaves no headroom for products (its X = 256 is sqrt(65504): under this assumption the
base's own MLP product may already reach the limit, and ordinary adapters would be refused), so in
fp16 only the logits are bounded.

Not bounded, because the base weights are not known here: what the base projections (o_proj,
down_proj, the next layers) make of a changed input, and softmax reweighting inside attention beyond
the convex-combination bound. An adapter that passes can still overflow on a base whose activations
exceed X; the engine's per-row non-finite check ends such requests with a named error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from adapters.factors import max_activation
from adapters.format import LoraPair
from adapters.types import AdapterValidationError, BaseModelShapes

SILU_SLOPE = 1.1  # max over x of |d/dx x sigmoid(x)| = 1.0998
SILU_FLOOR = 0.28  # max over x < 0 of |x sigmoid(x)| = 0.2785


def delta_gain(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """|scale| * max_i sum_k |B_ik| sum_j |A_kj|, which bounds ||scale B A||_inf (A [r, in], B [out, r])."""
    row_sums_a = a.double().abs().sum(dim=1)  # [r]
    return abs(scale) * float((b.double().abs() @ row_sums_a).max())


def check_composition(
    weights: Mapping[tuple[int, str], LoraPair], base: BaseModelShapes, dtype: torch.dtype
) -> None:
    """Refuse an adapter whose composed bound (module docstring) passes the dtype's range; `weights` are
    its factors by (layer, projection), as parsed in `dtype`."""
    gains = {key: delta_gain(pair.a, pair.b, pair.scale) for key, pair in weights.items()}
    x = max_activation(dtype)
    limit = torch.finfo(dtype).max
    fp32_limit = torch.finfo(torch.float32).max
    # The product of two activations has headroom only where X^2 is far below the range (not fp16).
    has_headroom = x * x <= limit / 2**16
    product_limit = limit if has_headroom else math.inf
    residual_limit = min(limit, math.sqrt(fp32_limit / base.hidden_size)) if has_headroom else math.inf
    residual = 0.0
    for layer in sorted({layer for layer, _ in gains}):
        d = {
            m: gains.get((layer, m), 0.0) * x for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        }
        logits = math.sqrt(base.head_dim) * (d["q_proj"] * (x + d["k_proj"]) + x * d["k_proj"])
        mlp = SILU_SLOPE * d["gate_proj"] * (x + d["up_proj"]) + (x + SILU_FLOOR) * d["up_proj"]
        added = gains.get((layer, "o_proj"), 0.0) * (x + d["v_proj"])
        added += gains.get((layer, "down_proj"), 0.0) * (x + mlp)
        residual += added
        for what, value, bound in (
            ("the attention logits' change (q/k deltas)", logits, fp32_limit),
            ("the MLP product's change (gate/up deltas)", mlp, product_limit),
            ("what the layer's deltas add to the residual stream", added, product_limit),
            (f"the residual stream's change summed over layers 0..{layer}", residual, residual_limit),
        ):
            if not value <= bound:  # also NaN
                raise AdapterValidationError(
                    f"layer {layer}: the adapter's composed delta can overflow {dtype}: {what} can reach "
                    f"{value:.3g} for block inputs |x| <= {x:g}; expected <= {bound:.3g}"
                )
