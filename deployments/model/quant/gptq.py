"""GPTQ int4 weights (with or without act-order, symmetric or not; the source layout:
``weights.quant``), stored in the pack as the checkpoint has them.

Kernels (``deployments.kernels.quant``): the Triton weight-only matmul for a decode step's rows
(act-order's ``g_idx`` read per input row, no reordering at pack time), else dequantize, then
multiply. Without act-order a checkpoint's ``g_idx`` (GPTQ writes one anyway) is ``k // group``,
which ``pack`` checks, so the kernels are not given it: they then read one row of scales and
zero points per group instead of one per input row."""

from __future__ import annotations

import torch

from deployments.kernels.quant import GPTQ, WeightSpec
from deployments.model.quant.awq import INT4_SCALE_DTYPES, group_of
from deployments.model.quant.base import QuantLinear, QuantMethod


class GptqMethod(QuantMethod):
    """``qweight`` int32 [K/8, N], ``qzeros`` int32 [K/G, N/8], ``scales`` [K/G, N], ``g_idx`` int32 [K]."""

    marker = "qweight"
    optional = ("g_idx",)
    dequant_bytes = 16  # as AWQ's

    def tensors(self, out_features: int, in_features: int) -> dict:
        N, K = out_features, in_features
        groups = -(-K // group_of(K, self.scheme.group_size))
        return {"qweight": ((K // 8, N), (torch.int32,)),
                "qzeros": ((groups, N // 8), (torch.int32,)),
                "scales": ((groups, N), INT4_SCALE_DTYPES),
                "g_idx": ((K,), (torch.int32,))}

    def spec(self, layer: QuantLinear) -> WeightSpec:
        return WeightSpec(GPTQ, layer.out_features, layer.in_features, layer.qweight, layer.scales, layer.qzeros,
                          g_idx=getattr(layer, "g_idx", None) if self.scheme.act_order else None,
                          group=group_of(layer.in_features, self.scheme.group_size),
                          zero_offset=self.scheme.zero_offset)
