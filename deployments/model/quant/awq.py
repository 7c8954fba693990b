"""AWQ int4 weights (version "gemm": zero points, group size G along the input; the source
layout: ``weights.quant``), stored in the pack as the checkpoint has them.

Kernels (``deployments.kernels.quant``): the Triton weight-only matmul for a decode step's rows,
else dequantize, then multiply."""

from __future__ import annotations

import torch

from deployments.kernels.quant import AWQ, WeightSpec
from deployments.model.quant.base import QuantLinear, QuantMethod

INT4_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def group_of(K: int, group_size: int) -> int:
    """Input rows per group (-1: all of them)."""
    return K if group_size == -1 else group_size


class AwqMethod(QuantMethod):
    """``qweight`` int32 [K, N/8], ``qzeros`` int32 [K/G, N/8], ``scales`` fp16 [K/G, N]."""

    marker = "qweight"
    dequant_bytes = 16  # nibbles and zero points unpacked (int32), their difference, the scales (fp32)

    def tensors(self, out_features: int, in_features: int) -> dict:
        N, K = out_features, in_features
        groups = -(-K // group_of(K, self.scheme.group_size))
        return {"qweight": ((K, N // 8), (torch.int32,)),
                "qzeros": ((groups, N // 8), (torch.int32,)),
                "scales": ((groups, N), INT4_SCALE_DTYPES)}

    def spec(self, layer: QuantLinear) -> WeightSpec:
        return WeightSpec(AWQ, layer.out_features, layer.in_features, layer.qweight, layer.scales, layer.qzeros,
                          group=group_of(layer.in_features, self.scheme.group_size))
