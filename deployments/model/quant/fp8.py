"""FP8 weights (float8_e4m3fn) with per-channel, per-tensor or block-wise scales:
compressed-tensors "float-quantized", fbgemm_fp8 and block-wise ``fp8`` checkpoints, and
``coldstart pack --quantize fp8`` packs (the source layouts: ``weights.quant``).

Kernels: on the CPU, and wherever no fp8 kernel passed its test, the weight is dequantized into
the activations' dtype and multiplied (a transient copy of one layer). The scales are not folded
into the product's columns (``(x @ W8^T) * s``) because fp8 values reach 448: in fp16 the
unscaled sums of a wide layer can pass 65504."""

from __future__ import annotations

import torch

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
            w["weight_scale_inv"] = ((-(-out_features // bn), -(-in_features // bk)), (torch.float32,) + _SCALE_DTYPES[1:])
        else:
            per_channel = self.scheme.strategy == "channel"
            w["weight_scale"] = ((out_features, 1) if per_channel else (1,), _SCALE_DTYPES)
        w["input_scale"] = ((1,), _SCALE_DTYPES)
        return w

    def dequantize(self, layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
        w = layer.weight.float()
        if self.block:
            bn, bk = self.block
            s = layer.weight_scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            return (w * s[: w.shape[0], : w.shape[1]]).to(dtype)
        return (w * layer.weight_scale.float().reshape(-1, 1)).to(dtype)
