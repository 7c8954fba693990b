"""Fused Triton kernels for the CUDA decode step.

After the GEMVs, a small-batch decode step is dominated by kernel launches: each
residual add, RMSNorm, SwiGLU and rope + KV-cache write is several tiny torch
kernels per layer. These three kernels do each of those jobs in one launch:

- `add_rms_norm`   residual add + RMSNorm (returns both the normed and the summed rows);
- `silu_mul`       SwiGLU on a fused gate|up projection;
- `rope_store_kv`  rope on q and k, k and v written into the static cache, one token per row.

All math is fp32 with one rounding at the end. Block sizes are fixed from the shapes
(no autotuning: compile time counts at server start). No host syncs and no
data-dependent allocation, so the kernels can be captured in a CUDA graph (launch
each once before capturing, so that compilation happens outside the capture).

Every public function falls back to its pure-torch reference (`_ref_*`) when Triton
or CUDA is missing, or when env COLDSTART_TRITON=0, so callers can always call them.
This module must stay cheap to import and never fail to: Triton is optional.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

triton = None
# A CPU-only process skips the import (0.2 s); the interpreter (TRITON_INTERPRET=1, the
# tests) runs the kernels on CPU tensors, so it imports Triton there too.
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or broken: the torch references are used instead
        triton = None

# Longest row `add_rms_norm` keeps in one Triton block; longer rows use the reference.
_MAX_NORM_BLOCK = 32768


def available(device: torch.device | str) -> bool:
    """True when Triton imports and the device is CUDA (and env COLDSTART_TRITON != "0")."""
    return (triton is not None and torch.device(device).type == "cuda"
            and os.environ.get("COLDSTART_TRITON", "1") != "0")


# ----------------------------------------------------------------------------- references


def _ref_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return F.rms_norm(summed, (x.shape[-1],), weight, eps), summed


def _ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _ref_rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, positions: torch.Tensor, n_heads: int, n_kv: int, head_dim: int
                       ) -> torch.Tensor:
    B, half, qk_width = qkv.shape[0], head_dim // 2, (n_heads + n_kv) * head_dim
    qk = qkv[:, :qk_width].float().view(B, n_heads + n_kv, head_dim)
    swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    qk = (qk * cos.float()[:, None] + swapped * sin.float()[:, None]).to(qkv.dtype)
    rows = torch.arange(B, device=qkv.device)
    k_cache[rows, :, positions] = qk[:, n_heads:]  # [B, n_kv, head_dim] at each row's position
    v_cache[rows, :, positions] = qkv[:, qk_width : qk_width + n_kv * head_dim].view(B, n_kv, head_dim)
    return qk[:, :n_heads].contiguous()


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(X, R, W, NORMED, SUMMED, stride_x, stride_r, D, eps, BLOCK: tl.constexpr):
        # One program per row: s = round(x + r); normed = round(s * rsqrt(mean(s^2) + eps) * w).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as torch's `x + r`
        tl.store(SUMMED + row * D + cols, s, mask=mask)
        s = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(NORMED + row * D + cols, (s * rstd * w).to(x.dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, stride_gu, n, BLOCK: tl.constexpr):
        # Grid (rows, column blocks): out = round(silu(gate) * up), gate|up side by side in a row.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
        u = tl.load(GU + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
        g32 = g.to(tl.float32)
        out = g32 / (1.0 + tl.exp(-g32)) * u
        tl.store(OUT + row * n + cols, out.to(g.dtype), mask=mask)

    @triton.jit
    def _rope_store_kv_kernel(QKV, COS, SIN, K_CACHE, V_CACHE, POS, Q_OUT, stride_qkv, stride_cos, stride_sin,
                              T, N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_HALF: tl.constexpr):
        # Grid (rows, q heads + k heads). Each program ropes one head, as two halves:
        # out_lo = x_lo*cos_lo + x_hi*sin_lo, out_hi = x_hi*cos_hi + x_lo*sin_hi (sin sign-folded).
        # A q head goes to Q_OUT; a k head goes into the cache at the row's position, and
        # the program also copies the matching v head there.
        HALF: tl.constexpr = HEAD_DIM // 2
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK_HALF)
        mask = d < HALF
        src = QKV + b * stride_qkv + h * HEAD_DIM  # q heads then k heads: head h starts at h * HEAD_DIM
        x_lo = tl.load(src + d, mask=mask, other=0.0)
        x_hi = tl.load(src + HALF + d, mask=mask, other=0.0).to(tl.float32)
        cos_lo = tl.load(COS + b * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
        cos_hi = tl.load(COS + b * stride_cos + HALF + d, mask=mask, other=0.0).to(tl.float32)
        sin_lo = tl.load(SIN + b * stride_sin + d, mask=mask, other=0.0).to(tl.float32)
        sin_hi = tl.load(SIN + b * stride_sin + HALF + d, mask=mask, other=0.0).to(tl.float32)
        dtype = x_lo.dtype
        x_lo = x_lo.to(tl.float32)
        out_lo = (x_lo * cos_lo + x_hi * sin_lo).to(dtype)
        out_hi = (x_hi * cos_hi + x_lo * sin_hi).to(dtype)
        if h < N_HEADS:
            dst = Q_OUT + (b * N_HEADS + h) * HEAD_DIM
            tl.store(dst + d, out_lo, mask=mask)
            tl.store(dst + HALF + d, out_hi, mask=mask)
        else:
            pos = tl.load(POS + b)
            if (pos >= 0) & (pos < T):  # an out-of-range position writes nothing
                off = ((b * N_KV + (h - N_HEADS)) * T + pos) * HEAD_DIM
                tl.store(K_CACHE + off + d, out_lo, mask=mask)
                tl.store(K_CACHE + off + HALF + d, out_hi, mask=mask)
                v_src = src + N_KV * HEAD_DIM  # v head j sits n_kv heads after k head j
                tl.store(V_CACHE + off + d, tl.load(v_src + d, mask=mask), mask=mask)
                tl.store(V_CACHE + off + HALF + d, tl.load(v_src + HALF + d, mask=mask), mask=mask)


def _launch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    D = x.shape[-1]
    x2, r2 = x.reshape(-1, D), residual.reshape(-1, D)  # views unless the leading dims can't merge
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    if x2.shape[0]:
        # the whole row in one block, ~16 elements per thread (4..32 warps)
        _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, normed, summed, x2.stride(0), r2.stride(0), D,
                                             eps, BLOCK=block, num_warps=min(max(block // 512, 4), 32))
    return normed, summed


def _launch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    F_ = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * F_)
    out = torch.empty((*gate_up.shape[:-1], F_), dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(F_), 1024)  # 4 warps: 8 elements (16 B of fp16) per thread
    if gu.shape[0]:
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(F_, block))](gu, out, gu.stride(0), F_, BLOCK=block,
                                                                 num_warps=4)
    return out


def _launch_rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, positions: torch.Tensor, n_heads: int, n_kv: int, head_dim: int
                          ) -> torch.Tensor:
    B = qkv.shape[0]
    q = torch.empty((B, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    block_half = triton.next_power_of_2(head_dim // 2)
    if B:
        # one warp per head up to head_dim 128 (2 elements per thread per half), else two
        _rope_store_kv_kernel[(B, n_heads + n_kv)](
            qkv, cos, sin, k_cache, v_cache, positions, q, qkv.stride(0), cos.stride(0), sin.stride(0),
            k_cache.shape[2], N_HEADS=n_heads, N_KV=n_kv, HEAD_DIM=head_dim, BLOCK_HALF=block_half,
            num_warps=1 if block_half <= 64 else 2)
    return q


# ----------------------------------------------------------------------------- public API


def _describe(t: object) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {_describe(t)}")
    if t.dim() == 0 or t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype or t.device != ref.device:
        raise ValueError(f"{name} must match {ref_name}'s dtype and device ({ref.dtype}, {ref.device}), "
                         f"got {t.dtype}, {t.device}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed): summed = x + residual rounded to x.dtype (exactly what `x + residual` gives),
    normed = F.rms_norm(summed, (D,), weight, eps) (fp32 statistics, one rounding at the end).
    x, residual: [..., D] same shape/dtype, last dim contiguous; weight [D]. New output tensors."""
    _check_float("x", x)
    _check_float("residual", residual)
    _check_float("weight", weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    _check_like("residual", residual, "x", x)
    _check_like("weight", weight, "x", x)
    if not available(x.device) or x.shape[-1] > _MAX_NORM_BLOCK:
        return _ref_add_rms_norm(x, residual, weight, eps)
    return _launch_add_rms_norm(x, residual, weight, float(eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2F] (gate = first F columns, up = last F). Returns silu(gate) * up as [..., F],
    computed in fp32, rounded once to the input dtype. Input may be a strided row view (last dim contiguous)."""
    _check_float("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate | up), got {gate_up.shape[-1]}")
    if not available(gate_up.device):
        return _ref_silu_mul(gate_up)
    return _launch_silu_mul(gate_up)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, positions: torch.Tensor, n_heads: int, n_kv: int, head_dim: int
                  ) -> torch.Tensor:
    """Decode step, one token per row. qkv: [B, (n_heads + 2*n_kv) * head_dim] (q heads, then k heads, then v heads,
    each head_dim wide; row stride may exceed the width). cos, sin: [B, head_dim] in qkv's dtype, where `sin` is
    SIGN-FOLDED: sin_folded = cat(-s[:half], s[half:]) so that rope(x) = x*cos + swap_halves(x)*sin_folded, with
    swap_halves(x) = cat(x[half:], x[:half]) (this equals HF's x*cos + rotate_half(x)*sin). Computes in fp32, rounds once.
    k_cache, v_cache: [slots, n_kv, T, head_dim] contiguous, slots >= B. positions: [B] int64.
    Writes rope(k) of row b into k_cache[b, :, positions[b], :] and v (unchanged) into v_cache[b, :, positions[b], :].
    Returns rope(q) as a NEW contiguous tensor [B, n_heads, head_dim].

    Positions must lie in [0, T): the Triton kernel skips the cache write of a row whose
    position does not (it cannot raise without a host sync); the reference raises.
    """
    for name, n in (("n_heads", n_heads), ("n_kv", n_kv), ("head_dim", head_dim)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    _check_float("qkv", qkv)
    width = (n_heads + 2 * n_kv) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [B, (n_heads + 2*n_kv) * head_dim] = [B, {width}], got {tuple(qkv.shape)}")
    B = qkv.shape[0]
    for name, t in (("cos", cos), ("sin", sin)):
        _check_float(name, t)
        if t.shape != (B, head_dim):
            raise ValueError(f"{name} must have shape ({B}, {head_dim}), got {tuple(t.shape)}")
        _check_like(name, t, "qkv", qkv)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(name, t)
        if t.dim() != 4 or t.shape[0] < B or t.shape[1] != n_kv or t.shape[3] != head_dim:
            raise ValueError(f"{name} must be [slots >= {B}, {n_kv}, T, {head_dim}], got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        _check_like(name, t, "qkv", qkv)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != (B,):
        raise ValueError(f"positions must be an int64 tensor of shape ({B},), got {_describe(positions)}")
    if positions.device != qkv.device:
        raise ValueError(f"positions must be on qkv's device {qkv.device}, got {positions.device}")
    if not available(qkv.device):
        return _ref_rope_store_kv(qkv, cos, sin, k_cache, v_cache, positions, n_heads, n_kv, head_dim)
    return _launch_rope_store_kv(qkv, cos, sin, k_cache, v_cache, positions, n_heads, n_kv, head_dim)


def self_test(hidden: int, intermediate: int, n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str) -> str | None:
    """Run each kernel once at a model's sizes and compare it with the torch reference.

    The first launch compiles a kernel (or takes it from Triton's cache), so this
    is where a missing C compiler or a broken Triton shows up: the caller then
    decodes with torch kernels instead of failing. One-row inputs with the real
    widths hit the same compiled specialisations as a batch-1 decode step.
    Returns why the kernels are not usable, or None when they are.
    """
    if not available(device):
        return "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    try:
        g = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(shape, device=device, dtype=torch.float32, generator=g).to(dtype)

        x, r, w = rnd(1, hidden), rnd(1, hidden), rnd(hidden)
        gu = rnd(1, 2 * intermediate)
        qkv, cos, sin = rnd(1, (n_heads + 2 * n_kv) * head_dim), rnd(1, head_dim), rnd(1, head_dim)
        # T=16: the divisibility of a real cache length, so the compiled kernel is the one decode uses
        caches = [torch.zeros(1, n_kv, 16, head_dim, device=device, dtype=dtype) for _ in range(4)]
        pos = torch.tensor([5], device=device)
        got = {"add_rms_norm": add_rms_norm(x, r, w, 1e-5)[0], "silu_mul": silu_mul(gu),
               "rope_store_kv": rope_store_kv(qkv, cos, sin, caches[0], caches[1], pos, n_heads, n_kv, head_dim)}
        want = {"add_rms_norm": _ref_add_rms_norm(x, r, w, 1e-5)[0], "silu_mul": _ref_silu_mul(gu),
                "rope_store_kv": _ref_rope_store_kv(qkv, cos, sin, caches[2], caches[3], pos, n_heads, n_kv,
                                                    head_dim)}
        got["kv_cache"], want["kv_cache"] = torch.cat(caches[:2]), torch.cat(caches[2:])
        for name in got:
            if not torch.allclose(got[name].float(), want[name].float(), **tol):
                err = (got[name].float() - want[name].float()).abs().max().item()
                return f"{name} differs from the torch reference by up to {err:.3g}"
    except Exception as e:  # noqa: BLE001 - any failure means: don't use them
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
