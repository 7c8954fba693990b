"""GPTQ int4 weights (with or without act-order, symmetric or not; the source layout:
``weights.quant``), stored in the pack as the checkpoint has them.

Kernels: dequantize, then multiply (the CPU, and wherever no int4 kernel passed its test)."""

from __future__ import annotations

import torch

from deployments.model.quant.awq import group_of, unpack_int4
from deployments.model.quant.base import QuantLinear, QuantMethod


class GptqMethod(QuantMethod):
    """``qweight`` int32 [K/8, N], ``qzeros`` int32 [K/G, N/8], ``scales`` [K/G, N], ``g_idx`` int32 [K]."""

    marker = "qweight"
    optional = ("g_idx",)

    def tensors(self, out_features: int, in_features: int) -> dict:
        N, K = out_features, in_features
        groups = -(-K // group_of(K, self.scheme.group_size))
        return {"qweight": ((K // 8, N), (torch.int32,)),
                "qzeros": ((groups, N // 8), (torch.int32,)),
                "scales": ((groups, N), (torch.float16, torch.bfloat16, torch.float32)),
                "g_idx": ((K,), (torch.int32,))}

    def groups(self, layer: QuantLinear) -> torch.Tensor:
        """Each input row's group [K] (int64): ``g_idx``, or k // G where the checkpoint has none."""
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None:
            return g_idx.long()
        K = layer.in_features
        return torch.arange(K, device=layer.qweight.device) // group_of(K, self.scheme.group_size)

    def dequantize(self, layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
        g = self.groups(layer)
        q = unpack_int4(layer.qweight, 0)  # [K, N]
        z = unpack_int4(layer.qzeros, 1)[g] + self.scheme.zero_offset
        s = layer.scales.float()[g]
        return ((q - z).float() * s).t().to(dtype)  # [N, K]
