"""FP8 weights (float8_e4m3fn) with per-channel, per-tensor or block-wise scales:
compressed-tensors "float-quantized", fbgemm_fp8 and block-wise ``fp8`` checkpoints, and
``coldstart pack --quantize fp8`` packs (the source layouts: ``weights.quant``).

Kernels (``deployments.kernels.quant``): the Triton weight-only matmul for a decode step's rows,
``torch._scaled_mm`` for wider ones (per-channel and per-tensor scales), else the weight
dequantized into the activations' dtype and multiplied. The scales are never folded into the
product's columns instead (``(x @ W8^T) * s``): fp8 values reach 448, and in fp16 the unscaled
sums of a wide layer can pass 65504."""

from __future__ import annotations

import torch

from deployments.kernels.quant import FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, WeightSpec
from deployments.model.quant.base import QuantLinear, QuantMethod

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Fp8Method(QuantMethod):
    """``weight`` fp8 [N, K] with ``weight_scale`` [N, 1] / [1] (or ``weight_scale_inv`` per block)."""

    optional = ("input_scale",)

    def __init__(self, scheme):
        super().__init__(scheme)
        self.block = scheme.block
        self.marker = "weight_scale_inv" if self.block else "weight_scale"

    def tensors(self, out_features: int, in_features: int) -> dict:
        w = {"weight": ((out_features, in_features), (torch.float8_e4m3fn,))}
        if self.block:
            bn, bk = self.block
            w["weight_scale_inv"] = ((-(-out_features // bn), -(-in_features // bk)), _SCALE_DTYPES)
        else:
            per_channel = self.scheme.strategy == "channel"
            w["weight_scale"] = ((out_features, 1) if per_channel else (1,), _SCALE_DTYPES)
        w["input_scale"] = ((1,), _SCALE_DTYPES)  # a static activation scale: unread (activations stay unquantized)
        return w

    def _scale(self, layers: list[QuantLinear]) -> torch.Tensor:
        """The stacked layers' scales: blocks of rows stacked, or one float32 scale per output row."""
        if self.block:
            return torch.cat([p.weight_scale_inv for p in layers])
        return torch.cat([p.weight_scale.float().reshape(-1, 1).expand(p.out_features, 1) for p in layers])

    def fuse(self, layers: list[QuantLinear], weight: torch.Tensor | None) -> QuantLinear | None:
        if weight is None:
            return None
        if self.block and any(p.out_features % self.block[0] for p in layers):
            return None  # a block of scales would straddle two layers
        bias = layers[0].bias is not None
        with torch.device("meta"):
            fused = QuantLinear(self, layers[0].in_features, weight.shape[0], bias, optional=("input_scale",))
        fused.weight = torch.nn.Parameter(weight, requires_grad=False)
        fused.parts = layers
        for name, t in self._copies(fused).items():
            setattr(fused, name, torch.nn.Parameter(t, requires_grad=False))
        return fused

    def _copies(self, fused: QuantLinear) -> dict[str, torch.Tensor]:
        """What a fused layer holds copied from its parts: the scales, and the biases (4 KiB-padded
        apart in a packed file)."""
        out = {self.marker: self._scale(fused.parts)}
        if fused.bias is not None:
            out["bias"] = torch.cat([p.bias for p in fused.parts])
        return out

    def refresh_fused(self, fused: QuantLinear) -> int:
        copies = self._copies(fused)
        for name, t in copies.items():
            getattr(fused, name).copy_(t)
        return len(copies)

    def spec(self, layer: QuantLinear) -> WeightSpec:
        if self.block:
            return WeightSpec(FP8_BLOCK, layer.out_features, layer.in_features, layer.weight, layer.weight_scale_inv,
                              block=self.block)
        scheme = FP8_CHANNEL if layer.weight_scale.numel() > 1 else FP8_TENSOR
        return WeightSpec(scheme, layer.out_features, layer.in_features, layer.weight, layer.weight_scale)
