"""The Triton kernels themselves (``@triton.jit``), defined where Triton imports.

``ops`` launches them; nothing else calls them. ``triton`` is None where Triton is not
installed or broken, or where no GPU is expected and the interpreter is off: a CPU-only
process skips the import (0.2 s). The choice is made without calling CUDA (a CUDA build of
torch, an NVIDIA driver's device file): a replica may import this module from Ray's worker
setup hook, before Ray has set its CUDA_VISIBLE_DEVICES, and CUDA fixes the devices a process
sees at its first call. The interpreter (TRITON_INTERPRET=1, the tests) runs the kernels on
CPU tensors, so it imports Triton there too.
"""

from __future__ import annotations

import torch

from deployments import envs
from deployments.device import gpu_expected

triton = None
if (torch.version.cuda and gpu_expected("auto")) or envs.read("TRITON_INTERPRET"):
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or broken: the torch references are used instead
        triton = None

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
                              T, BT, stride_bt, N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_HALF: tl.constexpr, PAGED: tl.constexpr, KV_BLOCK: tl.constexpr):
        # Grid (rows, q heads + k heads). Each program ropes one head, as two halves:
        # out_lo = x_lo*cos_lo + x_hi*sin_lo, out_hi = x_hi*cos_hi + x_lo*sin_hi (sin sign-folded).
        # A q head goes to Q_OUT; a k head goes into the cache at the row's position, and
        # the program also copies the matching v head there.
        # PAGED: the caches are [blocks, N_KV, KV_BLOCK, HEAD_DIM] and row b's position p is
        # offset p % KV_BLOCK of block BT[b, p // KV_BLOCK] (T = max_blocks * KV_BLOCK);
        # otherwise BT, stride_bt are None and KV_BLOCK is unused.
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
                if PAGED:
                    blk = tl.load(BT + b * stride_bt + pos // KV_BLOCK).to(tl.int64)
                    off = ((blk * N_KV + (h - N_HEADS)) * KV_BLOCK + pos % KV_BLOCK) * HEAD_DIM
                else:
                    off = ((b * N_KV + (h - N_HEADS)) * T + pos) * HEAD_DIM
                tl.store(K_CACHE + off + d, out_lo, mask=mask)
                tl.store(K_CACHE + off + HALF + d, out_hi, mask=mask)
                v_src = src + N_KV * HEAD_DIM  # v head j sits n_kv heads after k head j
                tl.store(V_CACHE + off + d, tl.load(v_src + d, mask=mask), mask=mask)
                tl.store(V_CACHE + off + HALF + d, tl.load(v_src + HALF + d, mask=mask), mask=mask)


    # The runtime ints are not specialised on (Triton would compile a variant per divisibility
    # by 16 of each): one compiled kernel serves every batch size, key length and split count.
    @triton.jit(do_not_specialize=["T", "kv_len", "window", "n_split"])
    def _decode_attn_split_kernel(Q, K, V, POS, M_OUT, L_OUT, ACC_OUT, T, kv_len, window, scale, n_split, BT,
                                  stride_bt, N_KV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                                  PAGED: tl.constexpr, KV_BLOCK: tl.constexpr):
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
        # (bench/kernel_sweep.py): the step is bound by reading the keys and values, which the
        # pipelined loop keeps in flight.
        # PAGED: K, V are [blocks, N_KV, KV_BLOCK, HEAD_DIM] and row b's key n is offset
        # n % KV_BLOCK of block BT[b, n // KV_BLOCK]: each key of a key block finds its cache
        # block (a key block may span several), so BLOCK_N is the static cache's whatever the
        # cache's block size. Otherwise BT, stride_bt are None and KV_BLOCK is unused.
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
            if PAGED:
                blk = tl.load(BT + b * stride_bt + n // KV_BLOCK, mask=live, other=0).to(tl.int64)
                tile = ((blk[:, None] * N_KV + h) * KV_BLOCK + (n % KV_BLOCK)[:, None]) * HEAD_DIM + d[None, :]
                k = tl.load(K + tile, mask=live[:, None], other=0.0)
                v = tl.load(V + tile, mask=live[:, None], other=0.0)
            else:
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
