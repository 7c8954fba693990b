"""The Triton kernels of quantized projections (``@triton.jit``): the weight-only matmul and the
one-pass dequantize, defined where Triton imports (``triton_jit``'s rule).
``deployments.kernels.quant`` launches them; nothing else does."""

from __future__ import annotations

from deployments.kernels.triton_jit import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dequant_tile(Q, S, Z, GI, k0, rk, n0, rn, N, K, stride_q, stride_s, stride_z, group, bn, bk, zero_offset,
                      SCHEME: tl.constexpr, HAS_GIDX: tl.constexpr, GROUP_TILE: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        # The weight's tile [BLOCK_K, BLOCK_N] (W^T[k, n] = W[n, k]) in fp32, from the stored layout
        # (weights.quant's docstring): 0 fp8 one scale, 1 fp8 a scale per output channel, 2 fp8
        # block scales, 3 AWQ int4, 4 GPTQ int4. Out-of-range elements are 0. GROUP_TILE: the
        # tile's rows k0.. lie in one int4 group, whose one row of scales and zero points is read.
        # An AWQ tile's words are loaded once each (BLOCK_N / 8 a row, side by side) and spread over
        # their eight columns in registers: each column loading its own word took 6-10 times longer.
        mask = (rk < K)[:, None] & (rn < N)[None, :]
        if SCHEME <= 2:
            q = tl.load(Q + rn.to(tl.int64)[None, :] * stride_q + rk[:, None], mask=mask, other=0.0).to(tl.float32)
            if SCHEME == 0:
                w = q * tl.load(S).to(tl.float32)
            elif SCHEME == 1:
                w = q * tl.load(S + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            else:
                s = tl.load(S + (rn // bn)[None, :] * stride_s + (rk // bk)[:, None], mask=mask, other=0.0)
                w = q * s.to(tl.float32)
        elif SCHEME == 3:
            # AWQ: column n at nibble (n % 8) // 2 + 4 * (n % 2) of word n // 8 (order 0 2 4 6 1 3 5 7)
            j = rn % 8
            shift = ((j // 2) + 4 * (j % 2)) * 4
            rw = n0 // 8 + tl.arange(0, BLOCK_N // 8)
            word = tl.load(Q + rk.to(tl.int64)[:, None] * stride_q + rw[None, :],
                           mask=(rk < K)[:, None] & (rw < N // 8)[None, :], other=0)
            word = tl.interleave(word, word)
            word = tl.interleave(word, word)
            word = tl.interleave(word, word)  # [BLOCK_K, BLOCK_N]: column n holds word n // 8
            q = (word >> shift[None, :]) & 0xF
            if GROUP_TILE:
                g0 = k0 // group
                zw = tl.load(Z + g0 * stride_z + rw, mask=rw < N // 8, other=0)
                zw = tl.interleave(zw, zw)
                zw = tl.interleave(zw, zw)
                zw = tl.interleave(zw, zw)
                z = (zw >> shift) & 0xF
                s = tl.load(S + g0 * stride_s + rn, mask=rn < N, other=0.0).to(tl.float32)
                w = (q - z[None, :]).to(tl.float32) * s[None, :]
            else:
                g = rk // group
                zw = tl.load(Z + g[:, None] * stride_z + (rn // 8)[None, :], mask=mask, other=0)
                z = (zw >> shift[None, :]) & 0xF
                s = tl.load(S + g[:, None] * stride_s + rn[None, :], mask=mask, other=0.0).to(tl.float32)
                w = (q - z).to(tl.float32) * s
        else:
            # GPTQ: row k at nibble k % 8 of word k // 8; zero points packed along n; g_idx or k // group
            word = tl.load(Q + (rk // 8).to(tl.int64)[:, None] * stride_q + rn[None, :], mask=mask, other=0)
            q = (word >> ((rk % 8) * 4)[:, None]) & 0xF
            if GROUP_TILE:
                g0 = k0 // group
                zw = tl.load(Z + g0 * stride_z + rn // 8, mask=rn < N, other=0)
                z = ((zw >> ((rn % 8) * 4)) & 0xF) + zero_offset
                s = tl.load(S + g0 * stride_s + rn, mask=rn < N, other=0.0).to(tl.float32)
                w = (q - z[None, :]).to(tl.float32) * s[None, :]
            else:
                if HAS_GIDX:
                    g = tl.load(GI + rk, mask=rk < K, other=0)
                else:
                    g = rk // group
                zw = tl.load(Z + g[:, None] * stride_z + (rn // 8)[None, :], mask=mask, other=0)
                z = ((zw >> ((rn % 8) * 4)[None, :]) & 0xF) + zero_offset
                s = tl.load(S + g[:, None] * stride_s + rn[None, :], mask=mask, other=0.0).to(tl.float32)
                w = (q - z).to(tl.float32) * s
        return w

    @triton.jit
    def _wo_matmul_kernel(X, Q, S, Z, GI, BIAS, Y, M, N, K, stride_xm, stride_ym, stride_q, stride_s, stride_z,
                          group, bn, bk, zero_offset, k_split, SCHEME: tl.constexpr, HAS_GIDX: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GROUP_TILE: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Y [M, N] = X [M, K] @ W^T (+ bias): the weight read once per BLOCK_M rows in its stored
        # form and dequantized in registers (a decode step reads 2 / 4 times fewer bytes than fp16),
        # rounded to X's dtype as the torch reference rounds the dequantized weight, then one
        # tensor-core product per tile with fp32 accumulation. SPLIT > 1: program (., ., s) sums
        # rows s * k_split.. of K only, into fp32 partial sums Y [SPLIT, M, N] that the caller adds
        # (in a fixed order: the same result every time), and the bias is the caller's.
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n0 = tl.program_id(0) * BLOCK_N
        rn = n0 + tl.arange(0, BLOCK_N)
        lo = tl.program_id(2) * k_split
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(lo, tl.minimum(lo + k_split, K), BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                        mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)
            w = _dequant_tile(Q, S, Z, GI, k0, rk, n0, rn, N, K, stride_q, stride_s, stride_z, group, bn, bk,
                              zero_offset, SCHEME, HAS_GIDX, GROUP_TILE, BLOCK_N).to(X.dtype.element_ty)
            if X.dtype.element_ty == tl.float32:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        out = (rm < M)[:, None] & (rn < N)[None, :]
        if SPLIT > 1:
            part = Y + tl.program_id(2).to(tl.int64) * M * N
            tl.store(part + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=out)
        else:
            if HAS_BIAS:
                acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=out)

    @triton.jit
    def _dequant_kernel(Q, S, Z, GI, W, N, K, stride_q, stride_s, stride_z, group, bn, bk, zero_offset,
                        SCHEME: tl.constexpr, HAS_GIDX: tl.constexpr, GROUP_TILE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # W [N, K] in its dtype: the stored weight's tile dequantized in fp32 and rounded once, as
        # kernels.quant.dequantize computes it, in one pass (no temporaries of the weight's size).
        k0 = tl.program_id(1) * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        n0 = tl.program_id(0) * BLOCK_N
        rn = n0 + tl.arange(0, BLOCK_N)
        w = _dequant_tile(Q, S, Z, GI, k0, rk, n0, rn, N, K, stride_q, stride_s, stride_z, group, bn, bk, zero_offset,
                          SCHEME, HAS_GIDX, GROUP_TILE, BLOCK_N)
        tl.store(W + rn.to(tl.int64)[None, :] * K + rk[:, None], w.to(W.dtype.element_ty),
                 mask=(rk < K)[:, None] & (rn < N)[None, :])
