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


# --- `coldstart demo --quant FORMAT`: random checkpoints in each format, for GPU benchmarks ------------

_FP8_CT = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}},
           "ignore": ["lm_head"]}
DEMO_FORMATS: dict[str, dict] = {
    "fp8": _FP8_CT,
    "fp8-tensor": {**_FP8_CT, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}}}},
    "fbgemm-fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
}
_STD = 0.02  # the dequantized weights' spread, as the plain demo's normal(0, 0.02)


def demo_specs(specs: list[tuple[str, tuple[int, ...]]], fmt: str, dtype: str
               ) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each tensor of a ``fmt`` checkpoint with the plain one's ``specs``:
    each projection weight replaced by the format's tensors (``weights.quant``'s layouts)."""
    from .quant import scheme_of

    sch = scheme_of({"quantization_config": DEMO_FORMATS[fmt]})
    out = []
    for name, shape in specs:
        if not is_projection_weight(name, shape):
            out.append((name, shape, dtype))
            continue
        base, (N, K) = name[: -len("weight")], shape
        if sch.method == "fp8":
            out.append((name, shape, "float8_e4m3fn"))
            if sch.block:
                out.append((base + "weight_scale_inv", (-(-N // sch.block[0]), -(-K // sch.block[1])), "float32"))
            else:
                out.append((base + "weight_scale", (N, 1) if sch.strategy == "channel" else (1,), "float32"))
            continue
        groups = -(-K // sch.group_size)
        qweight = (K, N // 8) if sch.method == "awq" else (K // 8, N)
        out += [(base + "qweight", qweight, "int32"), (base + "qzeros", (groups, N // 8), "int32"),
                (base + "scales", (groups, N), "float16")]
        if sch.method == "gptq":
            out.append((base + "g_idx", (K,), "int32"))
    return out


def demo_tensor(name: str, shape: tuple[int, ...], dtype: str, fmt: str, device: torch.device,
                gen: torch.Generator) -> torch.Tensor:
    """One random tensor of a ``fmt`` checkpoint's quantized projection (its dequantized weights
    spread like the plain demo's): fp8 values of about +-64 with scales 0.02 / 64; int4 words of
    nibbles drawn evenly from 1..15 around zero points of 8, scales 0.02 / 4.32 (their spread).
    Nibbles of 0..15 would centre every weight half a step below zero: a shared offset that each
    layer amplifies, until a deep model's fp16 activations overflow (a 32-layer 7B did)."""
    suffix = name.rsplit(".", 1)[1]
    if dtype == "float8_e4m3fn":
        return (torch.randn(shape, device=device, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if suffix in ("weight_scale", "weight_scale_inv"):
        return torch.full(shape, _STD / 64, device=device)
    if suffix == "qweight":
        nibbles = torch.randint(1, 16, (*shape, 8), device=device, generator=gen, dtype=torch.int64)
        words = (nibbles << (4 * torch.arange(8, device=device))).sum(-1)  # 0 .. 2^32 - 1
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    if suffix == "qzeros":  # zero point 8 in every nibble (GPTQ's "gptq" format stores 7: zero - 1)
        word = 0x77777777 if DEMO_FORMATS[fmt]["quant_method"] == "gptq" else 0x88888888 - 2**32
        return torch.full(shape, word, dtype=torch.int32, device=device)
    if suffix == "scales":
        return torch.full(shape, _STD / 4.32, dtype=torch.float16, device=device)
    if suffix == "g_idx":
        group = DEMO_FORMATS[fmt]["group_size"]
        if DEMO_FORMATS[fmt].get("desc_act"):
            return (torch.randperm(shape[0], device=device, generator=gen) // group).to(torch.int32)
        return (torch.arange(shape[0], device=device) // group).to(torch.int32)
    raise ValueError(f"demo_tensor: {name!r} is not a tensor of a {fmt} projection")
