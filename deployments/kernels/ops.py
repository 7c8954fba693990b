"""The fused decode-step operations: Triton launches with pure-torch references.

A small-batch decode step reads every weight once, and between those reads it
launches many tiny torch kernels: each residual add, RMSNorm, SwiGLU and rope +
KV-cache write is several per layer. These do each of those jobs in one launch:

- `add_rms_norm`      residual add + RMSNorm (returns both the normed and the summed rows);
- `silu_mul`          SwiGLU on a fused gate|up projection;
- `rope_store_kv`     rope on q and k, k and v written into the cache, one token per row;
- `decode_attention`  flash-decoding attention over the cache (key slices in parallel, then a merge);
- `gemv`              one row times a weight matrix, closer to the memory bandwidth than cuBLAS
                      on a 7B's shapes (``policy.gemv_choice`` times both and picks per shape).

The cache is static ([slots, n_kv, T, head_dim], row b in slot b) or, given a ``block_table``,
paged ([num_blocks, n_kv, block_size, head_dim], row b's position p at offset p % block_size of
block block_table[b, p // block_size]); `rope_store_kv` and `decode_attention` take either.

All math is fp32 with one rounding at the end. Block sizes are fixed from the shapes
(no autotuning: compile time counts at a replica's start). No host syncs and no
data-dependent allocation, so the operations can be captured in a CUDA graph (launch
each once before capturing, so that compilation happens outside the capture).

Every public function falls back to its pure-torch reference (`_ref_*`) when Triton
or CUDA is missing, or when COLDSTART_TRITON=0, so callers can always call them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deployments import envs
from deployments.kernels.triton_jit import triton

if triton is not None:
    from deployments.kernels.triton_jit import (_add_rms_norm_kernel, _decode_attn_reduce_kernel,
                                                _decode_attn_split_kernel, _gemv_kernel, _rope_store_kv_kernel,
                                                _silu_mul_kernel)

# Longest row `add_rms_norm` keeps in one Triton block; longer rows use the reference.
_MAX_NORM_BLOCK = 32768


def available(device: torch.device | str) -> bool:
    """True when Triton imports, the device is CUDA and COLDSTART_TRITON is not 0."""
    return triton is not None and torch.device(device).type == "cuda" and envs.read("COLDSTART_TRITON")


# ----------------------------------------------------------------------------- references

# ----------------------------------------------------------------------------- references


def _ref_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return F.rms_norm(summed, (x.shape[-1],), weight, eps), summed


def _ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _ref_rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, positions: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
                       block_table: torch.Tensor | None = None) -> torch.Tensor:
    B, half, qk_width = qkv.shape[0], head_dim // 2, (n_heads + n_kv) * head_dim
    qk = qkv[:, :qk_width].float().view(B, n_heads + n_kv, head_dim)
    swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    qk = (qk * cos.float()[:, None] + swapped * sin.float()[:, None]).to(qkv.dtype)
    rows = torch.arange(B, device=qkv.device)
    slot, offset = rows, positions
    if block_table is not None:
        # a position past the table, or a negative one, indexes past it: raises, without a host sync
        bs, max_blocks = k_cache.shape[2], block_table.shape[1]
        page = torch.where(positions >= 0, torch.div(positions, bs, rounding_mode="floor"), max_blocks)
        slot, offset = block_table[rows, page].long(), positions % bs
    k_cache[slot, :, offset] = qk[:, n_heads:]  # [B, n_kv, head_dim] at each row's position
    v_cache[slot, :, offset] = qkv[:, qk_width : qk_width + n_kv * head_dim].view(B, n_kv, head_dim)
    return qk[:, :n_heads].contiguous()


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Positions 0..kv_len-1 of each table row out of a paged cache [num_blocks, Hkv, bs, Dh],
    in order: [rows, Hkv, kv_len, Dh] (a copy)."""
    rows, bs = block_table.shape[0], cache.shape[2]
    n = -(-kv_len // bs)
    blocks = cache[block_table[:, :n].long()]  # [rows, n, Hkv, bs, Dh]
    return blocks.transpose(1, 2).reshape(rows, cache.shape[1], n * bs, cache.shape[3])[:, :, :kv_len]


def _ref_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                          kv_len: int, window: int, scale: float, block_table: torch.Tensor | None = None
                          ) -> torch.Tensor:
    B, H, Dh = q.shape
    if block_table is None:
        k, v = k_cache[:B, :, :kv_len], v_cache[:B, :, :kv_len]
    else:
        k, v = _gather_blocks(k_cache, block_table[:B], kv_len), _gather_blocks(v_cache, block_table[:B], kv_len)
    k, v = k.float(), v.float()  # [B, Hkv, L, Dh]
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


# ----------------------------------------------------------------------------- launches

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
                          v_cache: torch.Tensor, positions: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
                          block_table: torch.Tensor | None = None) -> torch.Tensor:
    B = qkv.shape[0]
    q = torch.empty((B, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    block_half = triton.next_power_of_2(head_dim // 2)
    paged = block_table is not None
    # T bounds the positions: the static cache's length, or the table's max_blocks * block_size.
    # The static cache passes None for the table (no kernel argument) and an unused KV_BLOCK of 1.
    T = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    if B:
        # one warp per head up to head_dim 128 (2 elements per thread per half), else two
        _rope_store_kv_kernel[(B, n_heads + n_kv)](
            qkv, cos, sin, k_cache, v_cache, positions, q, qkv.stride(0), cos.stride(0), sin.stride(0),
            T, block_table, block_table.stride(0) if paged else None, N_HEADS=n_heads, N_KV=n_kv,
            HEAD_DIM=head_dim, BLOCK_HALF=block_half, PAGED=paged, KV_BLOCK=k_cache.shape[2] if paged else 1,
            num_warps=1 if block_half <= 64 else 2)
    return q


def _gemv_blocks(K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a GEMV over K columns: the fastest of
    bench/kernel_sweep.py's grid for a 7B's shapes on an H200 (docs/measurements.md)."""
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
# one query head per kv head and for four alike (bench/kernel_sweep.py's grid, head size 128)
_ATTN_DEFAULTS = (64, 4, 528, 2)


def _launch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                             kv_len: int, window: int, scale: float, block_n: int | None = None,
                             num_warps: int | None = None, target: int | None = None,
                             num_stages: int | None = None, block_table: torch.Tensor | None = None
                             ) -> torch.Tensor:
    B, H, Dh = q.shape
    n_kv, T = k_cache.shape[1], k_cache.shape[2]  # T: a paged cache's block_size
    G = H // n_kv
    block_g = max(16, triton.next_power_of_2(G))
    bn, warps, tgt, stages = _ATTN_DEFAULTS
    block_n, num_warps, target, num_stages = block_n or bn, num_warps or warps, target or tgt, num_stages or stages
    paged = block_table is not None
    n_split = _decode_splits(B * n_kv, kv_len, block_n, target)
    m = torch.empty(B * H * n_split, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * H * n_split, Dh, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if B:
        _decode_attn_split_kernel[(B * n_kv, n_split)](
            q, k_cache, v_cache, positions, m, l_, acc, T, kv_len, window, scale, n_split, block_table,
            block_table.stride(0) if paged else None, N_KV=n_kv, G=G, HEAD_DIM=Dh, BLOCK_G=block_g,
            BLOCK_N=block_n, IEEE=q.dtype == torch.float32, PAGED=paged, KV_BLOCK=T if paged else 1,
            num_warps=num_warps, num_stages=num_stages)
        _decode_attn_reduce_kernel[(B * H,)](m, l_, acc, out, n_split, HEAD_DIM=Dh, BLOCK_S=_MAX_SPLITS,
                                             num_warps=4)
    return out


# ----------------------------------------------------------------------------- public API


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


def _check_block_table(block_table: torch.Tensor, rows: int, ref_name: str, ref: torch.Tensor) -> None:
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] < rows or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be an int32 tensor [rows >= {rows}, max_blocks >= 1], "
                         f"got {_describe(block_table)}")
    if not block_table.is_contiguous():
        raise ValueError(f"block_table must be contiguous, got shape {tuple(block_table.shape)} "
                         f"strides {block_table.stride()}")
    if block_table.device != ref.device:
        raise ValueError(f"block_table must be on {ref_name}'s device {ref.device}, got {block_table.device}")


def _check_paged_cache(name: str, t: torch.Tensor, n_kv: int | None, head_dim: int) -> None:
    """A paged cache: contiguous [num_blocks, n_kv, block_size, head_dim], block_size a power of two >= 16."""
    if t.dim() != 4 or (n_kv is not None and t.shape[1] != n_kv) or t.shape[3] != head_dim \
            or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous paged cache [num_blocks, {n_kv or 'n_kv'}, block_size, "
                         f"{head_dim}], got {_describe(t)}")
    bs = t.shape[2]
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"{name}'s block_size (dim 2) must be a power of two >= 16, got {bs}")


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
                  v_cache: torch.Tensor, positions: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
                  block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Decode step, one token per row. qkv: [B, (n_heads + 2*n_kv) * head_dim] (q heads, then k heads, then v heads,
    each head_dim wide; row stride may exceed the width). cos, sin: [B, head_dim] in qkv's dtype, where `sin` is
    SIGN-FOLDED: sin_folded = cat(-s[:half], s[half:]) so that rope(x) = x*cos + swap_halves(x)*sin_folded, with
    swap_halves(x) = cat(x[half:], x[:half]) (this equals HF's x*cos + rotate_half(x)*sin). Computes in fp32, rounds once.
    k_cache, v_cache: [slots, n_kv, T, head_dim] contiguous, slots >= B. positions: [B] int64.
    Writes rope(k) of row b into k_cache[b, :, positions[b], :] and v (unchanged) into v_cache[b, :, positions[b], :].
    Returns rope(q) as a NEW contiguous tensor [B, n_heads, head_dim].

    Positions must lie in [0, T): the Triton kernel skips the cache write of a row whose
    position does not (it cannot raise without a host sync); the reference raises.

    With ``block_table`` ([rows >= B, max_blocks] int32, contiguous, on qkv's device) the caches
    are paged: k_cache, v_cache [num_blocks, n_kv, block_size, head_dim] contiguous, block_size a
    power of two >= 16, and row b's k and v go to [block_table[b, p // block_size], :, p % block_size, :]
    with p = positions[b]; positions must lie in [0, max_blocks * block_size) (skipped / raises as
    above). The table's entries must be block indices < num_blocks (not checked: they live on the device).
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
        if block_table is not None:
            _check_paged_cache(name, t, n_kv, head_dim)
        elif t.dim() != 4 or t.shape[0] < B or t.shape[1] != n_kv or t.shape[3] != head_dim:
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
    if block_table is not None:
        _check_block_table(block_table, B, "qkv", qkv)
    if not available(qkv.device):
        return _ref_rope_store_kv(qkv, cos, sin, k_cache, v_cache, positions, n_heads, n_kv, head_dim, block_table)
    return _launch_rope_store_kv(qkv, cos, sin, k_cache, v_cache, positions, n_heads, n_kv, head_dim, block_table)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_len: int, window: int, scale: float, block_table: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """One decode step's attention, flash-decoding style (key slices in parallel, then a merge).

    q: [B, n_heads, head_dim] contiguous (as `rope_store_kv` returns it); k_cache, v_cache:
    [slots >= B, n_kv, T, head_dim] contiguous; row b reads slot b's keys 0..kv_len-1 that
    are <= positions[b] (and > positions[b] - window when window > 0). A row whose position
    is >= kv_len is the engine's padding: it reads every key, so that it stays finite (it
    writes the cache too, and a NaN there would poison the slot's next user). head_dim must
    be a power of two >= 16. Returns [B, n_heads, head_dim] in q's dtype.

    With ``block_table`` ([rows >= B, max_blocks] int32, contiguous, on q's device) the caches
    are paged: [num_blocks, n_kv, block_size, head_dim] contiguous, block_size a power of two
    >= 16, and row b's key p is k_cache[block_table[b, p // block_size], :, p % block_size, :]
    (same masks, same result as the static cache holding the same keys); kv_len <= max_blocks *
    block_size. The entries of the keys a row reads must be block indices < num_blocks (not
    checked: they live on the device); entries no sequence owns may point to a null block of
    finite values.
    """
    _check_float("q", q)
    if q.dim() != 3 or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous [B, n_heads, head_dim] tensor, got {_describe(q)}")
    B, H, Dh = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(name, t)
        if block_table is not None:
            _check_paged_cache(name, t, None, Dh)
        elif t.dim() != 4 or t.shape[0] < B or t.shape[3] != Dh or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [slots >= {B}, n_kv, T, {Dh}] tensor, got {_describe(t)}")
        _check_like(name, t, "q", q)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if H % k_cache.shape[1]:
        raise ValueError(f"n_heads={H} is not a multiple of the cache's n_kv={k_cache.shape[1]}")
    if Dh < 16 or Dh & (Dh - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {Dh}")
    if block_table is not None:
        _check_block_table(block_table, B, "q", q)
        max_len, bound = block_table.shape[1] * k_cache.shape[2], " (max_blocks * block_size)"
    else:
        max_len, bound = k_cache.shape[2], ""
    if not isinstance(kv_len, int) or not 0 < kv_len <= max_len:
        raise ValueError(f"kv_len must be an int in [1, {max_len}]{bound}, got {kv_len!r}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: none), got {window!r}")
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != (B,):
        raise ValueError(f"positions must be an int64 tensor of shape ({B},), got {_describe(positions)}")
    if not available(q.device):
        return _ref_decode_attention(q, k_cache, v_cache, positions, kv_len, window, float(scale), block_table)
    return _launch_decode_attention(q, k_cache, v_cache, positions, kv_len, window, float(scale),
                                    block_table=block_table)


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
