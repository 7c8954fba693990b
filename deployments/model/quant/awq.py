"""AWQ int4 weights (version "gemm": zero points, group size G along the input; the source
layout: ``weights.quant``), stored in the pack as the checkpoint has them.

Kernels: dequantize, then multiply (the CPU, and wherever no int4 kernel passed its test)."""

from __future__ import annotations

import torch

from deployments.model.quant.base import QuantLinear, QuantMethod
from weights.quant import AWQ_ORDER


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of ``weights.quant.pack_int4``: int32 words -> eight values (0..15, int32)
    each along ``dim``, element 8 j + order[i] from nibble i of word j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    x = packed.movedim(dim, -1)
    nib = (x.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8]: nibble i
    inv = [0] * 8
    for i, j in enumerate(order):
        inv[j] = i
    nib = nib[..., inv]  # element j of each word's eight
    return nib.reshape(*x.shape[:-1], -1).movedim(-1, dim)


def group_of(K: int, group_size: int) -> int:
    return K if group_size == -1 else group_size


class AwqMethod(QuantMethod):
    """``qweight`` int32 [K, N/8], ``qzeros`` int32 [K/G, N/8], ``scales`` fp16 [K/G, N]."""

    marker = "qweight"

    def tensors(self, out_features: int, in_features: int) -> dict:
        N, K = out_features, in_features
        groups = -(-K // group_of(K, self.scheme.group_size))
        return {"qweight": ((K, N // 8), (torch.int32,)),
                "qzeros": ((groups, N // 8), (torch.int32,)),
                "scales": ((groups, N), (torch.float16, torch.bfloat16, torch.float32))}

    def dequantize(self, layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
        G = group_of(layer.in_features, self.scheme.group_size)
        q = unpack_int4(layer.qweight, 1, AWQ_ORDER)  # [K, N]
        z = unpack_int4(layer.qzeros, 1, AWQ_ORDER).repeat_interleave(G, 0)[: q.shape[0]]
        s = layer.scales.float().repeat_interleave(G, 0)[: q.shape[0]]
        return ((q - z).float() * s).t().to(dtype)  # [N, K]
