"""Fused Triton kernels for the CUDA decode step.

A small-batch decode step reads every weight once, and between those reads it
launches many tiny torch kernels: each residual add, RMSNorm, SwiGLU and rope +
KV-cache write is several per layer. These kernels do each of those jobs in one launch:

- `add_rms_norm`      residual add + RMSNorm (returns both the normed and the summed rows);
- `silu_mul`          SwiGLU on a fused gate|up projection;
- `rope_store_kv`     rope on q and k, k and v written into the static cache, one token per row;
- `decode_attention`  flash-decoding attention over the cache (key slices in parallel, then a merge);
- `gemv`              one row times a weight matrix, closer to the memory bandwidth than cuBLAS
                      on the 7B's shapes; `gemv_choice` times both at start and picks per shape.

All math is fp32 with one rounding at the end. Block sizes are fixed from the shapes
(no autotuning: compile time counts at server start). No host syncs and no
data-dependent allocation, so the kernels can be captured in a CUDA graph (launch
each once before capturing, so that compilation happens outside the capture).

Every public function falls back to its pure-torch reference (`_ref_*`) when Triton
or CUDA is missing, or when env COLDSTART_TRITON=0, so callers can always call them.
This module must stay cheap to import and never fail to: Triton is optional.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from deployments import head_start

triton = None
# A CPU-only process skips the import (0.2 s); the interpreter (TRITON_INTERPRET=1, the
# tests) runs the kernels on CPU tensors, so it imports Triton there too. Decided without
# calling CUDA (a CUDA build of torch, a GPU driver's device file): a replica may import this
# module before Ray has set its CUDA_VISIBLE_DEVICES (deployments.early), and CUDA fixes the
# devices a process sees at its first call.
if (torch.version.cuda and head_start.gpu_expected("auto")) or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or broken: the torch references are used instead
        triton = None

log = logging.getLogger("deployments.kernels")

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


def _ref_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                          kv_len: int, window: int, scale: float) -> torch.Tensor:
    B, H, Dh = q.shape
    k = k_cache[:B, :, :kv_len].float()  # [B, Hkv, L, Dh]
    v = v_cache[:B, :, :kv_len].float()
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # head h reads kv head h // rep
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    key = torch.arange(kv_len, device=q.device)
    pos = positions.view(B, 1, 1)
    allowed = key <= pos
    if window:
        allowed = allowed & ((key > pos - window) | (pos >= kv_len))
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhl,bhld->bhd", probs, v).to(q.dtype)


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


    # The runtime ints are not specialised on (Triton would compile a variant per divisibility
    # by 16 of each): one compiled kernel serves every batch size, key length and split count.
    @triton.jit(do_not_specialize=["T", "kv_len", "window", "n_split"])
    def _decode_attn_split_kernel(Q, K, V, POS, M_OUT, L_OUT, ACC_OUT, T, kv_len, window, scale, n_split,
                                  N_KV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # Flash-decoding, part 1. Grid (rows * kv heads, splits): the G query heads that share
        # one kv head attend to one slice of its keys with an online softmax; writes the
        # slice's running max, sum and unnormalised output (fp32). Causal (key <= position)
        # and, when window > 0, sliding-window masks come from the row's position.
        # Each row's keys are cut into n_split slices of its own length (up to its position,
        # whole key blocks), so a row near the start of its sequence spreads as well over the
        # GPU as a long one, whatever kv_len (the grid's bound) is: one CUDA graph per batch
        # size serves every length.
        # Tensor-core dots in the cache's dtype with fp32 accumulation, the G query heads padded
        # to BLOCK_G (>= 16) rows: with one query head per kv head, 15 of 16 rows are padding,
        # and still faster than the same products on the CUDA cores, or than the batched matmuls
        # (bench/kernel_sweep.py, bench/results/runs/attention-sweep-v1.json): the step is
        # bound by reading the keys and values, which the pipelined loop keeps in flight.
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b = bh // N_KV
        h = bh % N_KV
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        pos = tl.load(POS + b)
        q = tl.load(Q + ((b * N_KV + h) * G + g[:, None]) * HEAD_DIM + d[None, :], mask=g[:, None] < G,
                    other=0.0)
        kv_base = (b * N_KV + h) * T * HEAD_DIM
        # no key past the row's position is read: its blocks would only be masked (and a stale
        # NaN there would still reach acc through 0 * NaN); a padding row (pos >= kv_len) reads all
        row_len = tl.minimum(kv_len, pos + 1)
        chunk = tl.cdiv(tl.cdiv(row_len, n_split), BLOCK_N) * BLOCK_N
        start = split * chunk
        m_i = tl.full((BLOCK_G,), -1e30, tl.float32)  # finite: an all-masked block adds nothing
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
        end = tl.minimum(start + chunk, row_len)
        # a for loop, so that Triton pipelines it: the next key block's loads are in flight
        # while this one's dots run (num_stages at launch)
        for n0 in tl.range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < end
            k = tl.load(K + kv_base + n[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
            v = tl.load(V + kv_base + n[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
            if IEEE:  # an fp32 cache: full-precision dots (Triton's default would round to tf32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, BLOCK_N], fp32
            ok = live & (n <= pos)
            if window > 0:  # a padding row (position >= kv_len) sees every key: it must stay finite
                ok = ok & ((n > pos - window) | (pos >= kv_len))
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = ((b * N_KV + h) * G + g) * n_split + split  # [BLOCK_G] partial index
        tl.store(M_OUT + row, m_i, mask=g < G)
        tl.store(L_OUT + row, l_i, mask=g < G)
        tl.store(ACC_OUT + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g[:, None] < G)

    @triton.jit(do_not_specialize=["N_SPLIT"])
    def _decode_attn_reduce_kernel(M_IN, L_IN, ACC_IN, OUT, N_SPLIT, HEAD_DIM: tl.constexpr,
                                   BLOCK_S: tl.constexpr):
        # Flash-decoding, part 2. One program per (row, query head): rescale the splits to
        # their common max and normalise; one rounding to the output dtype.
        r = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, HEAD_DIM)
        m = tl.load(M_IN + r * N_SPLIT + sp, mask=sp < N_SPLIT, other=-float("inf"))
        w = tl.exp(m - tl.max(m, axis=0))
        l_sum = tl.sum(tl.load(L_IN + r * N_SPLIT + sp, mask=sp < N_SPLIT, other=0.0) * w, axis=0)
        acc = tl.load(ACC_IN + (r * N_SPLIT + sp[:, None]) * HEAD_DIM + d[None, :], mask=sp[:, None] < N_SPLIT,
                      other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / l_sum
        tl.store(OUT + r * HEAD_DIM + d, out.to(OUT.dtype.element_ty))

    @triton.jit
    def _gemv_kernel(X, W, BIAS, Y, N, stride_w, K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y = W x (+ bias) for one row x; W [N, K] row-major. Each program reduces BLOCK_N rows
        # of W over all of K. K is a compile-time constant, so the K loop is unrolled and its
        # loads can all be in flight at once: a batch-1 decode step is bound by reading W.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_row = W + rn.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            k = k0 + rk
            if k0 + BLOCK_K <= K:
                x = tl.load(X + k)
                if EVEN_N:
                    w = tl.load(w_row + k[None, :])
                else:
                    w = tl.load(w_row + k[None, :], mask=(rn < N)[:, None], other=0.0)
            else:
                x = tl.load(X + k, mask=k < K, other=0.0)
                w = tl.load(w_row + k[None, :], mask=(rn < N)[:, None] & (k < K)[None, :], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=rn < N)


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


def _gemv_blocks(K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a GEMV over K columns: the fastest in
    bench/kernel_sweep.py on an H200 for the 7B's shapes (4.0-4.3 TB/s against
    cuBLAS's 2.6-4.0; bench/results/runs/kernel-sweep.json)."""
    return (2, 1024, 4) if K >= 8192 else (1, 1024, 8)


def _launch_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                 blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    N, K = w.shape
    block_n, block_k, warps = blocks or _gemv_blocks(K)
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, bias if bias is not None else w, y, N, w.stride(0), K=K, HAS_BIAS=bias is not None,
        EVEN_N=N % block_n == 0, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(K)),
        num_warps=warps)
    return y


_MAX_SPLITS = 64  # key slices per (row, kv head) at most: the merge reads them in one block


def _decode_splits(rows: int, kv_len: int, block_n: int, target: int) -> int:
    """Key slices per (row, kv head): enough programs to fill a large GPU (~``target`` of
    them), at least one key block per slice of a ``kv_len``-long row."""
    return max(1, min(triton.cdiv(kv_len, block_n), triton.cdiv(target, rows), _MAX_SPLITS))


# block_n, num_warps, target, num_stages: the least time summed over the sweep's cases, for
# one query head per kv head and for four alike (bench/kernel_sweep.py on an H200, Dh 128)
_ATTN_DEFAULTS = (64, 4, 528, 2)


def _launch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                             kv_len: int, window: int, scale: float, block_n: int | None = None,
                             num_warps: int | None = None, target: int | None = None,
                             num_stages: int | None = None) -> torch.Tensor:
    B, H, Dh = q.shape
    n_kv, T = k_cache.shape[1], k_cache.shape[2]
    G = H // n_kv
    block_g = max(16, triton.next_power_of_2(G))
    bn, warps, tgt, stages = _ATTN_DEFAULTS
    block_n, num_warps, target, num_stages = block_n or bn, num_warps or warps, target or tgt, num_stages or stages
    n_split = _decode_splits(B * n_kv, kv_len, block_n, target)
    m = torch.empty(B * H * n_split, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * H * n_split, Dh, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if B:
        _decode_attn_split_kernel[(B * n_kv, n_split)](
            q, k_cache, v_cache, positions, m, l_, acc, T, kv_len, window, scale, n_split, N_KV=n_kv, G=G,
            HEAD_DIM=Dh, BLOCK_G=block_g, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
            num_warps=num_warps, num_stages=num_stages)
        _decode_attn_reduce_kernel[(B * H,)](m, l_, acc, out, n_split, HEAD_DIM=Dh, BLOCK_S=_MAX_SPLITS,
                                             num_warps=4)
    return out


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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_len: int, window: int, scale: float) -> torch.Tensor:
    """One decode step's attention, flash-decoding style (key slices in parallel, then a merge).

    q: [B, n_heads, head_dim] contiguous (as `rope_store_kv` returns it); k_cache, v_cache:
    [slots >= B, n_kv, T, head_dim] contiguous; row b reads slot b's keys 0..kv_len-1 that
    are <= positions[b] (and > positions[b] - window when window > 0). A row whose position
    is >= kv_len is the engine's padding: it reads every key, so that it stays finite (it
    writes the cache too, and a NaN there would poison the slot's next user). head_dim must
    be a power of two >= 16. Returns [B, n_heads, head_dim] in q's dtype.
    """
    _check_float("q", q)
    if q.dim() != 3 or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous [B, n_heads, head_dim] tensor, got {_describe(q)}")
    B, H, Dh = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(name, t)
        if t.dim() != 4 or t.shape[0] < B or t.shape[3] != Dh or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [slots >= {B}, n_kv, T, {Dh}] tensor, got {_describe(t)}")
        _check_like(name, t, "q", q)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if H % k_cache.shape[1]:
        raise ValueError(f"n_heads={H} is not a multiple of the cache's n_kv={k_cache.shape[1]}")
    if Dh < 16 or Dh & (Dh - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {Dh}")
    if not isinstance(kv_len, int) or not 0 < kv_len <= k_cache.shape[2]:
        raise ValueError(f"kv_len must be an int in [1, {k_cache.shape[2]}], got {kv_len!r}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: none), got {window!r}")
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != (B,):
        raise ValueError(f"positions must be an int64 tensor of shape ({B},), got {_describe(positions)}")
    if not available(q.device):
        return _ref_decode_attention(q, k_cache, v_cache, positions, kv_len, window, float(scale))
    return _launch_decode_attention(q, k_cache, v_cache, positions, kv_len, window, float(scale))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for a single row x ([K] or [1, ..., 1, K]) with the Triton GEMV.
    w: [N, K] with contiguous rows; fp32 accumulation, one rounding. Falls back to F.linear
    where Triton does not run."""
    _check_float("x", x)
    _check_float("w", w)
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.numel() != w.shape[1]:
        raise ValueError(f"gemv needs one row x of width K and w [N, K], got x {_describe(x)}, w {_describe(w)}")
    _check_like("w", w, "x", x)
    if bias is not None:
        _check_like("bias", bias, "x", x)
        if bias.shape != (w.shape[0],) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous ({w.shape[0]},) tensor, got {_describe(bias)}")
    if not available(x.device):
        return F.linear(x, w, bias)
    return _launch_gemv(x.contiguous(), w, bias)


def capture_graph(fn: Callable[[], object], device: torch.device | str) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (compiles, picks algorithms), then captured as a CUDA graph."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):  # loader threads may run meanwhile
        fn()
    return g


def graph_ms(fn: Callable[[], object], device: torch.device | str, replays: int = 3) -> float:
    """GPU time of one call of ``fn`` (several launches), captured as a CUDA graph so that
    Python's launch overhead is not what is measured; the best of a few replays."""
    g = capture_graph(fn, device)
    best = float("inf")
    for _ in range(replays + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


# ----------------------------------------------------------------------------- verdicts kept per node


def verdict_dir() -> Path | None:
    """Where a replica keeps its kernel verdicts (the GEMV choice): files beside Triton's
    compiled kernels, which live as long as the node's (or volume's) kernel cache.
    None (never kept) with env COLDSTART_KERNEL_VERDICTS=0 (``head_start.kept_dir``)."""
    where = head_start.kept_dir()
    return None if where is None else Path(where)


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    """This module's code, hashed once per process (every verdict's key has it)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def verdict_path(kind: str, judged: Any, device: torch.device, where: Path) -> Path:
    """The file for the verdict on ``judged`` (shapes, dtypes, options) on this GPU, keyed on
    everything else that could change it: the GPU model, torch, its CUDA, Triton, this
    module's code. A node with another of these gets its own verdict."""
    props = torch.cuda.get_device_properties(device)
    code = _code_hash()
    blob = json.dumps([kind, judged, props.name, [props.major, props.minor], torch.__version__,
                       torch.version.cuda, getattr(triton, "__version__", None), code], sort_keys=True, default=str)
    return where / f"coldstart-{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"


def _read_verdict(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # torn or foreign: judged again and rewritten
        log.warning("ignoring kernel verdict %s (%s); judging again", path, e)
        return None
    return doc if isinstance(doc, dict) else None


def _write_verdict(path: Path, doc: dict) -> None:
    """Atomically (a reader sees the old file, no file, or the whole new one); a directory
    that cannot be written just means judging again at the next start."""
    e = head_start.write_kept(path, json.dumps(doc, indent=1))
    if e is not None:
        log.info("kernel verdict not kept (%s): the next start judges again", e)


def _cached_gemv_choice(doc: dict | None, names: list[str]
                        ) -> tuple[set[tuple[int, int]], dict[str, dict]] | None:
    try:
        chosen = {(int(n), int(k)) for n, k in doc["chosen"]}  # type: ignore[index]
        report = {name: dict(doc["report"][name], cached=True) for name in names}  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None
    return chosen, report


def gemv_choice(groups: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]], margin: float = 0.02,
                keep: Path | None = None) -> tuple[set[tuple[int, int]], dict[str, dict]]:
    """Which weight shapes a batch-1 decode step should multiply with the Triton GEMV.

    ``groups``: projection name -> its (weight, bias) in every layer. For each, checks the
    GEMV against F.linear on one layer's weight, then times both over all the layers (the
    real weights, so caches behave as in decoding) and picks the GEMV where it is faster by
    more than ``margin``. The weights' values are never read for the verdict (the timing does
    not depend on them). About a millisecond per projection and method. Returns the chosen
    (N, K) shapes and, per projection, the timings or why the GEMV was not usable.

    ``keep``: a directory (``verdict_dir()``) where a verdict without errors is kept and
    found again by the next start with the same shapes on the same kind of GPU and software
    (0.2 s of a 7B replica's start on an H200); its report rows then say ``cached``.
    """
    path = None
    if keep is not None and groups:
        w0 = next(iter(groups.values()))[0][0]
        if available(w0.device):
            judged = {name: [list(p[0][0].shape), str(p[0][0].dtype), len(p), p[0][1] is not None]
                      for name, p in groups.items()}
            path = verdict_path("gemv", [judged, margin], w0.device, keep)
            found = _cached_gemv_choice(_read_verdict(path), list(groups))
            if found is not None:
                return found
    chosen, report = _time_gemv_choice(groups, margin)
    if path is not None and not any("error" in r for r in report.values()):
        _write_verdict(path, {"chosen": sorted(chosen), "report": report})
    return chosen, report


def _time_gemv_choice(groups: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]], margin: float
                      ) -> tuple[set[tuple[int, int]], dict[str, dict]]:
    chosen: set[tuple[int, int]] = set()
    report: dict[str, dict] = {}
    for name, pairs in groups.items():
        w0, b0 = pairs[0]
        if not available(w0.device):
            report[name] = {"error": "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"}
            continue
        rnd = _rand(w0.dtype, w0.device)
        x = rnd(1, w0.shape[1])
        # checked on random values of the weight's width, never on the weights themselves: a
        # replica builds its model while the weights' bytes are still arriving. Up to 4096 rows
        # plus the shape's remainder modulo 64, so the kernel's tail handling is covered too
        N, K = w0.shape
        wt = rnd(min(N, 4096 + N % 64), K) * K**-0.5  # outputs of a real layer's size
        bt = None if b0 is None else rnd(wt.shape[0])
        why = _compare(lambda: iter([(name, gemv(x, wt, bt), F.linear(x, wt, bt))]), w0.dtype)
        wt = bt = None  # free it before the timing
        if why:
            report[name] = {"error": why}
            continue
        try:
            ms_torch = graph_ms(lambda: [F.linear(x, w, b) for w, b in pairs], w0.device)
            ms_triton = graph_ms(lambda: [_launch_gemv(x, w, b) for w, b in pairs], w0.device)
        except Exception as e:  # noqa: BLE001 - a failed timing just keeps cuBLAS
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        faster = ms_triton < ms_torch * (1 - margin)
        report[name] = {"shape": list(w0.shape), "torch_ms": round(ms_torch, 4), "triton_ms": round(ms_triton, 4),
                        "triton": faster}
        if faster:
            chosen.add(tuple(w0.shape))
    return chosen, report


def _rand(dtype: torch.dtype, device: torch.device | str) -> Callable[..., torch.Tensor]:
    """Seeded standard-normal tensors of ``dtype`` on ``device``, for the self-tests."""
    g = torch.Generator(device=device).manual_seed(0)
    return lambda *shape: torch.randn(shape, device=device, dtype=torch.float32, generator=g).to(dtype)


def _timing(times: dict[str, float] | None, device: torch.device | str) -> Callable[..., Any]:
    """``timed(key, fn, *args)``: ``fn(*args)``, and where ``times`` is a dict, its seconds up to
    the device's completion added to ``times[key]`` (the self-tests' split: Triton's first
    launches against the torch references')."""
    cuda = torch.device(device).type == "cuda"  # (the Triton interpreter runs on the CPU)

    def timed(key: str, fn: Callable[..., Any], *args: Any) -> Any:
        if times is None:
            return fn(*args)
        t = time.perf_counter()
        out = fn(*args)
        if cuda:
            torch.cuda.synchronize(device)
        times[key] = times.get(key, 0.0) + time.perf_counter() - t
        return out
    return timed


def _compare(cases: Callable[[], Iterator[tuple[str, torch.Tensor, torch.Tensor]]], dtype: torch.dtype) -> str | None:
    """Run ``(name, kernel result, torch reference)`` cases; why one failed or disagreed, else None."""
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    try:
        for name, got, want in cases():
            if not torch.allclose(got.float(), want.float(), **tol):
                err = (got.float() - want.float()).abs().max().item()
                return f"{name} differs from the torch reference by up to {err:.3g}"
    except Exception as e:  # noqa: BLE001 - any failure means: don't use the kernels
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _selftest_path(judged: list, device: torch.device | str, keep: Path | None) -> Path | None:
    """Where a self-test's pass is kept: only for a CUDA device (the Triton interpreter's
    runs on the CPU are never kept)."""
    device = torch.device(device)
    return None if keep is None or device.type != "cuda" else verdict_path("selftest", judged, device, keep)


def kept_test(path: Path | None, run: Callable[[], str | None]) -> str | None:
    """``run()``, a self-test (why the kernels are not usable, or None), unless a start before
    this one passed the same test on this node: its verdict, kept at ``path`` (``verdict_path``:
    same GPU model, torch, CUDA, Triton and kernel code), says so. A pass is kept; a failure
    never is (the next start tests again). A torn or foreign file is tested again and rewritten."""
    doc = None if path is None else _read_verdict(path)
    if path is not None and doc is not None and doc.get("passed") is True:
        log.info("kernel self-test passed on this node before (%s): not run again", path.name)
        return None
    why = run()
    if why is None and path is not None:
        _write_verdict(path, {"passed": True})
    return why


def self_test(hidden: int, intermediate: int, n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str, times: dict[str, float] | None = None,
              keep: Path | None = None) -> str | None:
    """Run each kernel once at a model's sizes and compare it with the torch reference.

    The first launch compiles a kernel (or takes it from Triton's cache), so this
    is where a missing C compiler or a broken Triton shows up: the caller then
    decodes with torch kernels instead of failing. One-row inputs with the real
    widths hit the same compiled specialisations as a batch-1 decode step.
    Returns why the kernels are not usable, or None when they are. ``times`` (a dict): seconds
    added under "wait" (for Triton's head start), "triton" (the kernels) and "torch" (the
    references), each up to the device's completion. ``keep``: a directory (``verdict_dir()``)
    where a pass is kept, so that the next start on this node with the same GPU and software
    skips the comparison (``kept_test``). In a warm 7B replica's start on an H200 that took the
    self-tests' 0.57 s away, but most of it was the kernels' own first loads, which then come
    with their first use (the capture's first launches, 0.31 -> 0.63 s): the engine's start
    went from 1.74 to 1.68 s (bench/results/serve.json against runs/serve-v10-start-split.json).
    """
    if not available(device):
        return "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"
    judged = ["kernels", hidden, intermediate, n_heads, n_kv, head_dim, str(dtype)]
    path = _selftest_path(judged, device, keep)
    timed = _timing(times, device)

    def cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        rnd = _rand(dtype, device)
        x, r, w = rnd(1, hidden), rnd(1, hidden), rnd(hidden)
        yield ("add_rms_norm", timed("triton", add_rms_norm, x, r, w, 1e-5)[0],
               timed("torch", _ref_add_rms_norm, x, r, w, 1e-5)[0])
        gu = rnd(1, 2 * intermediate)
        yield "silu_mul", timed("triton", silu_mul, gu), timed("torch", _ref_silu_mul, gu)
        qkv, cos, sin = rnd(1, (n_heads + 2 * n_kv) * head_dim), rnd(1, head_dim), rnd(1, head_dim)
        # T=16: the divisibility of a real cache length, so the compiled kernel is the one decode uses
        caches = [torch.zeros(1, n_kv, 16, head_dim, device=device, dtype=dtype) for _ in range(4)]
        pos = torch.tensor([5], device=device)
        yield ("rope_store_kv",
               timed("triton", rope_store_kv, qkv, cos, sin, caches[0], caches[1], pos, n_heads, n_kv, head_dim),
               timed("torch", _ref_rope_store_kv, qkv, cos, sin, caches[2], caches[3], pos, n_heads, n_kv,
                     head_dim))
        yield "kv_cache", torch.cat(caches[:2]), torch.cat(caches[2:])

    def test() -> str | None:  # (kept: nothing is launched, nothing to wait for)
        timed("wait", head_start.wait)  # Triton's per-process set-up, begun on a side thread at the replica's start
        return _compare(cases, dtype)
    return kept_test(path, test)


def attention_self_test(n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device | str, times: dict[str, float] | None = None,
                        keep: Path | None = None) -> str | None:
    """As `self_test`, for `decode_attention` at a model's head sizes; None when usable."""
    if not available(device):
        return "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    timed = _timing(times, device)
    judged = ["attention", n_heads, n_kv, head_dim, str(dtype)]
    path = _selftest_path(judged, device, keep)

    def cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        # One row over 512 keys of a longer cache: the kernels are compiled for the model's head
        # sizes and dtype only (not for the lengths and split counts, which are runtime
        # arguments), so this compiles (or loads) exactly what every decode step launches
        rnd = _rand(dtype, device)
        q, kc, vc = rnd(1, n_heads, head_dim), rnd(1, n_kv, 1024, head_dim), rnd(1, n_kv, 1024, head_dim)
        pos = torch.tensor([300], device=device)
        for window in (0, 64):
            yield ("decode_attention", timed("triton", decode_attention, q, kc, vc, pos, 512, window, head_dim**-0.5),
                   timed("torch", _ref_decode_attention, q, kc, vc, pos, 512, window, head_dim**-0.5))

    return kept_test(path, lambda: _compare(cases, dtype))
