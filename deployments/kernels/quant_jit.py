"""The Triton kernels of quantized projections (``@triton.jit``): the weight-only matmul, its
one-row GEMV, the one-pass dequantize and the fp8 matmul's row quantisation, defined where
Triton imports (``triton_jit``'s rule).
``deployments.kernels.quant`` launches them; nothing else does."""

from __future__ import annotations

from deployments.kernels.triton_jit import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dequant_tile(Q, S, Z, GI, k0, rk, n0, rn, N, K, stride_q, stride_s, stride_z, group, bn, bk, zero_offset,
                      SCHEME: tl.constexpr, HAS_GIDX: tl.constexpr, GROUP_TILE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # The weight's tile [BLOCK_K, BLOCK_N] (W^T[k, n] = W[n, k]) in fp32, from the stored layout
        # (weights.quant's docstring): 0 fp8 one scale, 1 fp8 a scale per output channel, 2 fp8
        # block scales, 3 AWQ int4, 4 GPTQ int4. Out-of-range elements are 0. GROUP_TILE: the
        # tile's rows k0.. lie in one int4 group, whose one row of scales and zero points is read (none
        # where k0 is past K: a GEMV's unrolled last part; k0 broadcast, as the interpreter wants).
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
                zw = tl.load(Z + g0 * stride_z + rw, mask=(rw < N // 8) & (k0 + 0 * rw < K), other=0)
                zw = tl.interleave(zw, zw)
                zw = tl.interleave(zw, zw)
                zw = tl.interleave(zw, zw)
                z = (zw >> shift) & 0xF
                s = tl.load(S + g0 * stride_s + rn, mask=(rn < N) & (k0 + 0 * rn < K), other=0.0).to(tl.float32)
                w = (q - z[None, :]).to(tl.float32) * s[None, :]
            else:
                g = rk // group
                zw = tl.load(Z + g[:, None] * stride_z + (rn // 8)[None, :], mask=mask, other=0)
                z = (zw >> shift[None, :]) & 0xF
                s = tl.load(S + g[:, None] * stride_s + rn[None, :], mask=mask, other=0.0).to(tl.float32)
                w = (q - z).to(tl.float32) * s
        else:
            # GPTQ: row k at nibble k % 8 of word k // 8; zero points packed along n; g_idx or k // group.
            # A tile's words are loaded once each (BLOCK_K / 8 rows of them) and spread over their
            # eight rows in registers, as AWQ's over their columns (k0 is a multiple of 8).
            rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            word = tl.load(Q + rw.to(tl.int64)[:, None] * stride_q + rn[None, :],
                           mask=(rw < (K + 7) // 8)[:, None] & (rn < N)[None, :], other=0)
            q = (word[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
            q = tl.reshape(q, (BLOCK_K, BLOCK_N))  # row 8 r + i from nibble i of word row r
            if GROUP_TILE:
                g0 = k0 // group
                zw = tl.load(Z + g0 * stride_z + rn // 8, mask=(rn < N) & (k0 + 0 * rn < K), other=0)
                z = ((zw >> ((rn % 8) * 4)) & 0xF) + zero_offset
                s = tl.load(S + g0 * stride_s + rn, mask=(rn < N) & (k0 + 0 * rn < K), other=0.0).to(tl.float32)
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
    def _store_out(acc, offs, mask, Y, WS, CNT, BIAS, b_offs, tile, part, part_stride,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
        # A program's sum over its part of K (acc, fp32) into Y (contiguous) at offs. SPLIT 1: the
        # whole sum, stored. Else it goes to the workspace WS [SPLIT, ...Y's shape], and the last of the tile's SPLIT programs to get
        # there (counted in CNT[tile], with acquire-release order: the others' parts are visible to
        # it) adds the parts in their order, part 0 first: the same sum whichever program ends last,
        # in one launch. It sets the counter back to 0 for the next launch.
        if SPLIT > 1:
            tl.store(WS + part * part_stride + offs, acc, mask=mask)
            tl.debug_barrier()  # every thread's part stored before the count
            if tl.atomic_add(CNT + tile, 1) == SPLIT - 1:
                acc = tl.load(WS + offs, mask=mask, other=0.0, cache_modifier=".cg")
                for p in tl.static_range(1, SPLIT):
                    acc += tl.load(WS + p * part_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(BIAS + b_offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)
                tl.store(CNT + tile, 0)
        else:
            if HAS_BIAS:
                acc += tl.load(BIAS + b_offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _wo_matmul_kernel(X, Q, S, Z, GI, BIAS, Y, WS, CNT, M, N, K, stride_xm, stride_q, stride_s,
                          stride_z, group, bn, bk, zero_offset, k_split, SCHEME: tl.constexpr,
                          HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_TILE: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Y [M, N] = X [M, K] @ W^T (+ bias): the weight read once per BLOCK_M rows in its stored
        # form and dequantized in registers (a decode step reads 2 / 4 times fewer bytes than fp16),
        # rounded to X's dtype as the torch reference rounds the dequantized weight, then one
        # tensor-core product per tile with fp32 accumulation. SPLIT > 1: program (., ., s) sums
        # rows s * k_split.. of K only (_store_out adds the parts).
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
                              zero_offset, SCHEME, HAS_GIDX, GROUP_TILE, BLOCK_N, BLOCK_K).to(X.dtype.element_ty)
            if X.dtype.element_ty == tl.float32:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        _store_out(acc, rm.to(tl.int64)[:, None] * N + rn[None, :], (rm < M)[:, None] & (rn < N)[None, :],
                   Y, WS, CNT, BIAS, rn[None, :] + 0 * rm[:, None],
                   tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.program_id(2).to(tl.int64), M * N,
                   HAS_BIAS, SPLIT)

    @triton.jit
    def _wo_gemv_kernel(X, Q, S, Z, GI, BIAS, Y, WS, CNT, N, K, stride_q, stride_s, stride_z, group, bn, bk,
                        zero_offset, SCHEME: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GROUP_TILE: tl.constexpr, SPLIT: tl.constexpr, K_PART: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y [N] = W x (+ bias) for one row x: program (n, s) sums outputs n * BLOCK_N.. over rows
        # s * K_PART.. of K (_store_out adds the parts). The part's steps are unrolled (K_PART is a
        # constant), so the weight's loads can all be in flight at once: one row's product is bound
        # by reading the weight. Products on the CUDA cores, summed along K in registers and reduced
        # once at the end (a tensor-core tile would be 15/16 padding).
        n0 = tl.program_id(0) * BLOCK_N
        rn = n0 + tl.arange(0, BLOCK_N)
        part = tl.program_id(1)
        acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
        for i in tl.static_range(0, K_PART, BLOCK_K):
            k0 = part * K_PART + i
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rk, mask=rk < K, other=0.0).to(tl.float32)
            w = _dequant_tile(Q, S, Z, GI, k0, rk, n0, rn, N, K, stride_q, stride_s, stride_z, group, bn, bk,
                              zero_offset, SCHEME, HAS_GIDX, GROUP_TILE, BLOCK_N, BLOCK_K)
            acc += w * x[:, None]
        _store_out(tl.sum(acc, axis=0), rn, rn < N, Y, WS, CNT, BIAS, rn, tl.program_id(0), part.to(tl.int64), N,
                   HAS_BIAS, SPLIT)

    @triton.jit
    def _quant_rows_kernel(X, XQ, XS, M, K, stride_xm, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
        # Row m of X [M, K] in fp8 with its own scale (its largest magnitude / FP8_MAX, at least
        # 1e-12), as kernels.quant._quantize_rows computes them, one program a row; rows M.. (the
        # padding the fp8 matmul needs) are zeros with scale 1.
        m = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        row = X + m.to(tl.int64) * stride_xm
        out = XQ + m.to(tl.int64) * K
        if m < M:
            amax = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), 1e-12)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
                q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
                tl.store(out + k0 + rk, q.to(XQ.dtype.element_ty), mask=k0 + rk < K)
            tl.store(XS + m, scale)
        else:
            for k0 in range(0, K, BLOCK_K):
                tl.store(out + k0 + rk, tl.zeros((BLOCK_K,), tl.float32).to(XQ.dtype.element_ty), mask=k0 + rk < K)
            tl.store(XS + m, 1.0)

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
                          SCHEME, HAS_GIDX, GROUP_TILE, BLOCK_N, BLOCK_K)
        tl.store(W + rn.to(tl.int64)[None, :] * K + rk[:, None], w.to(W.dtype.element_ty),
                 mask=(rk < K)[:, None] & (rn < N)[None, :])
