"""int8 base weights (`--quantization int8`): per-output-channel symmetric, round-to-nearest, at load.

Every `nn.Linear` of the decoder (q/k/v, o, gate/up, down) becomes an `Int8Linear`; the embeddings and
the LM head stay in the serving dtype. Weight row i is stored as `q[i] = round(W[i] / s[i])` clamped to
[-127, 127] with `s[i] = max|W[i]| / 127` held in the serving dtype, and the layer computes
`x @ (q * s).T (+ bias)` through `torch._weight_int8pack_mm` (weight-only: activations stay in the
serving dtype, the int8 weights are widened inside the kernel). The LoRA deltas are added on top in the
serving dtype as before (kernels.sgmv), so adapters see the dequantized base weights, as QLoRA-trained
adapters expect. `weight` gives the dequantized matrix (DoRA's weight norms, the float64 oracle).

A compressed-tensors checkpoint (compressed_tensors.py) brings its own q and s (`Int8Linear.from_int8`);
a W8A8 one also quantizes activations per token at run time (`is_dynamic_activations`): each input row
gets s_x = max|x| / 127 and x_q = round(x / s_x) in [-128, 127], `torch._int_mm` sums x_q @ q.T in
int32 (exact), and y = acc * s_x * s (+ bias), in float32 then the serving dtype. Its `scale` stays in
float32 there (the int32 product is scaled once); weight-only layers hold it in the serving dtype.

Speed on this CPU (AVX512-BF16 + VNNI, no AMX; SmolLM2 shapes, 1 thread), vs bf16 `F.linear`:
batch 1 1.9-2.4x faster (half the weight bytes), batch 32 0.4-0.5x (the int8pack kernel is a
weight-streaming GEMV; oneDNN's bf16 GEMM reuses each weight across 32 rows). See benchmarks/int8_decode.py.
"""

from __future__ import annotations

import torch
from torch import nn

# torch._weight_int8pack_mm with 16-bit activations needs in_features % 16 == 0 (K = 40 segfaults in
# torch 2.13 CPU; 16, 32, 48, 64, 96, 128, 192 measured fine); float32 takes any K.
BF16_K_MULTIPLE = 16


class Int8Linear(nn.Module):
    """A `nn.Linear` with per-output-channel int8 weights (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(self.dtype)  # all-zero rows: q = 0
        q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q.contiguous())  # [out, in] int8
        self.register_buffer("scale", scale.contiguous())  # [out] in the serving dtype
        self.bias = linear.bias
        self.is_dynamic_activations = False  # weight-only: activations stay in the serving dtype

    @classmethod
    def from_int8(
        cls,
        linear: nn.Linear,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        *,
        is_dynamic_activations: bool,
    ) -> Int8Linear:
        """A layer holding a checkpoint's own int8 `qweight` [out, in] and `scale` [out] (compressed-tensors);
        `linear` gives the shape, dtype and bias. W8A8 (`is_dynamic_activations`) keeps `scale` in float32."""
        if qweight.dtype != torch.int8 or tuple(qweight.shape) != tuple(linear.weight.shape):
            raise ValueError(
                f"int8 weight must be int8 {tuple(linear.weight.shape)}, "
                f"got {qweight.dtype} {tuple(qweight.shape)}"
            )
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.dtype = linear.weight.dtype
        layer.register_buffer("qweight", qweight.contiguous())
        keep = torch.float32 if is_dynamic_activations else layer.dtype
        layer.register_buffer("scale", scale.reshape(-1).to(keep).contiguous())
        layer.bias = linear.bias
        layer.is_dynamic_activations = is_dynamic_activations
        return layer

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight `q * s` [out, in] in the serving dtype (computed on each call)."""
        return (self.qweight.float() * self.scale.float()[:, None]).to(self.dtype)

    def _w8a8(self, rows: torch.Tensor) -> torch.Tensor:
        """[m, in] -> [m, out] float32: per-token int8 activations times the int8 weight (see above)."""
        x = rows.float()
        s_x = x.abs().amax(dim=1, keepdim=True) / 127.0  # [m, 1]
        s_x = torch.where(s_x > 0, s_x, torch.ones_like(s_x))  # an all-zero row: x_q = 0
        x_q = torch.round(x / s_x).clamp_(-128, 127).to(torch.int8)
        acc = torch._int_mm(x_q, self.qweight.t())  # [m, out] int32, exact
        return acc.float() * s_x * self.scale.float()[None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.is_dynamic_activations:
            y = self._w8a8(rows).to(x.dtype)
        elif x.dtype == torch.float32 or self.in_features % BF16_K_MULTIPLE == 0:
            y = torch._weight_int8pack_mm(rows, self.qweight, self.scale)
        else:  # torch 2.13's 16-bit kernel crashes on such K (e.g. 40): the float32 one, rounded once
            y = torch._weight_int8pack_mm(rows.float(), self.qweight, self.scale.float()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def quantize_int8(model: nn.Module, *, keep: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every `nn.Linear` of `model` except those named in `keep` by an `Int8Linear`, in place;
    returns how many were replaced. Refuses a device other than the CPU (the kernel used is CPU-only here)."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in keep
    ]
    for name, module in targets:
        if module.weight.device.type != "cpu":
            raise ValueError(
                f"quantization int8 runs on the CPU only (layer {name} is on {module.weight.device})"
            )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module))
    return len(targets)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())
