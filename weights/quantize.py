"""Reference quantisers: a floating-point projection weight as each scheme stores it (the layouts:
``weights.quant``), for ``coldstart pack --quantize fp8``, ``coldstart demo --quant`` and the
tests."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .quant import FP8_MAX, is_projection_weight


def quantize_fp8(w: torch.Tensor, strategy: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [N, K], weight_scale float32 [N, 1] or [1]) of w [N, K], as
    compressed-tensors' float quantisation: scale = absmax / 448, weight = clamp(w / scale)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / (scale if strategy == "channel" else scale[0])).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)]) of w [N, K]."""
    N, K = w.shape
    bn, bk = block
    gn, gk = -(-N // bn), -(-K // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:N, :K] = w.float()
    tiles = padded.view(gn, bn, gk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [gn, gk]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gn * bn, gk * bk)[:N, :K]
    return q.contiguous().to(torch.float8_e4m3fn), scale


def int4_groups(w: torch.Tensor, group: int, zero_point: bool, g_idx: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantisation of w [N, K] by groups of input rows: (q int32 [K, N]
    in 0..15, zeros int32 [K/G, N], scales fp16 [K/G, N], g_idx int32 [K]). ``g_idx``: each
    input row's group (act-order); default k // G. Symmetric: zero 8."""
    N, K = w.shape
    G = K if group == -1 else group
    n_groups = -(-K // G)
    if g_idx is None:
        g_idx = torch.arange(K, dtype=torch.int32) // G
    wt = w.float().t()  # [K, N]
    scales = torch.empty(n_groups, N)
    zeros = torch.full((n_groups, N), 8, dtype=torch.int32)
    for g in range(n_groups):
        rows = wt[g_idx == g]
        if zero_point:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = ((hi - lo) / 15).clamp(min=1e-5)
            zeros[g] = torch.round(-lo / scales[g]).to(torch.int32).clamp(0, 15)
        else:
            scales[g] = (rows.abs().amax(0) / 7.5).clamp(min=1e-5)
    scales = scales.half()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = (torch.round(wt / s) + z).clamp(0, 15).to(torch.int32)
    return q, zeros, scales, g_idx.to(torch.int32)




def pack_int4(x: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values (int32, 0..15) per int32 word along ``dim`` of a 2-D x: nibble i of
    word j holds element 8 j + order[i]."""
    x = x.to(torch.int32).movedim(dim, -1)
    if x.shape[-1] % 8:
        raise ValueError(f"pack_int4: {x.shape[-1]} values along dim {dim} are not a multiple of 8")
    x = x.reshape(*x.shape[:-1], -1, 8)
    out = torch.zeros(x.shape[:-1], dtype=torch.int64)
    for i, j in enumerate(order):
        out |= (x[..., j].to(torch.int64) & 0xF) << (4 * i)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)  # the same 32 bits, signed
    return out.movedim(-1, dim).contiguous()



def fp8_metas(metas: Mapping[str, Any]) -> dict:
    """The tensors of an fp8 pack of ``metas`` (name -> ``weights.sources.SourceTensor``): each
    projection weight float8_e4m3fn, with its float32 ``weight_scale`` [N, 1] beside it."""
    out = {}
    for name, m in metas.items():
        if is_projection_weight(name, m.shape):
            out[name] = type(m)(name, m.file, "float8_e4m3fn", m.shape)
            scale = name[: -len("weight")] + "weight_scale"
            out[scale] = type(m)(scale, m.file, "float32", (m.shape[0], 1))
        else:
            out[name] = m
    return out


def fp8_stream(tensors: Any) -> Any:
    """(name, tensor, file) of an fp8 pack, from the source's stream: each projection weight
    quantized per output channel as it arrives (`quantize_fp8`), its scale following it."""
    for name, t, file in tensors:
        if is_projection_weight(name, tuple(t.shape)) and t.is_floating_point():
            q, scale = quantize_fp8(t, "channel")
            yield name, q, file
            yield name[: -len("weight")] + "weight_scale", scale, file
        else:
            yield name, t, file
