"""Inputs and tolerances shared by the kernel tests (tests/test_kernels.py, tests/test_kernels_device.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def rerun_interpreted(test_file: str, timeout: float) -> tuple[subprocess.CompletedProcess, str]:
    """``test_file``'s test_interp_* cases again in a fresh process with TRITON_INTERPRET=1 (skipped
    where Triton is absent, and inside that process itself); the process and its summary line."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_", test_file],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=timeout)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return proc, summary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: tight; fp16/bf16: about 2 ulps (rtol = 2 * eps) with a small atol for values near 0.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
EPS = 1e-6

NORM_SHAPES = [(1, 64), (3, 4096), (3, 4100), (2, 5, 96)]
SILU_SHAPES = [(1, 2 * 64), (3, 2 * 4100), (2, 3, 2 * 11)]
# (B, n_heads, n_kv, head_dim, qkv row padding): MHA, GQA, head_dim 64/128, and 80 (half not a power of 2)
ROPE_CASES = [(1, 4, 4, 64, 0), (3, 8, 2, 128, 16), (3, 6, 2, 64, 8), (2, 4, 2, 80, 0)]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype: torch.dtype, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def norm_inputs(shape, dtype, device="cpu", seed=0, pad=0):
    """x (rows padded when `pad`: a strided row view), residual, weight."""
    g = gen(seed)
    D = shape[-1]
    x = randn(*shape[:-1], D + pad, dtype=dtype, g=g, device=device)[..., :D]
    return x, randn(*shape, dtype=dtype, g=g, device=device), randn(D, dtype=dtype, g=g, device=device)


def rope_inputs(B, H, Hkv, Dh, pad, dtype, device="cpu", T=32, slots=None, seed=0):
    """qkv, cos, sign-folded sin, k_cache, v_cache, positions (distinct) and the plain HF sin."""
    g = gen(seed)
    width = (H + 2 * Hkv) * Dh
    qkv = randn(B, width + pad, dtype=dtype, g=g, device=device)[:, :width]
    positions = torch.randperm(T, generator=g)[:B].to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, Dh, 2, dtype=torch.float32) / Dh))
    freqs = positions.cpu().float()[:, None] * inv_freq[None]  # [B, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # HF order
    cos, sin = emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)
    h = Dh // 2
    sin_folded = torch.cat((-sin[:, :h], sin[:, h:]), dim=-1)
    k_cache = randn(slots or B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    v_cache = randn(slots or B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    return qkv, cos, sin_folded, k_cache, v_cache, positions, sin


ATTN_CASES = [(1, 4, 4, 64, 256, 200, 0), (3, 8, 2, 128, 512, 512, 0), (2, 6, 2, 16, 96, 70, 24),
              (3, 4, 1, 32, 1024, 1000, 0), (2, 4, 4, 32, 128, 100, 16)]


def attn_inputs(B, H, Hkv, Dh, T, kv_len, dtype, device="cpu", seed=0):
    g = gen(seed)
    q = randn(B, H, Dh, dtype=dtype, g=g, device=device)
    kc = randn(B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    vc = randn(B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    pos = torch.randint(0, kv_len, (B,), generator=g)
    pos[-1] = T - 1  # the engine's padding rows sit at the last position: they see every key
    return q, kc, vc, pos.to(device)


# (B, n_heads, n_kv, head_dim, block_size, kv_len, window) of a paged cache: GQA and MHA, head_dim
# 16/32/64, block sizes 16 and 32 (and 128: several key blocks of the kernel in one cache block),
# kv_len not a whole number of blocks, sliding windows
PAGED_CASES = [(4, 8, 2, 64, 16, 100, 0), (3, 4, 4, 32, 32, 70, 0), (4, 6, 2, 16, 16, 64, 20),
               (3, 4, 1, 32, 32, 96, 40), (3, 4, 4, 16, 128, 200, 0)]


def paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, device="cpu", seed=0, max_blocks=None, null_padding=False):
    """q, a paged cache (k, v [num_blocks, Hkv, bs, Dh]), its block table [B + 1, max_blocks]
    int32, the same logical keys as static caches (k, v [B + 1, Hkv, max_blocks * bs, Dh]) and
    the positions [B].

    Row 0 is at position 0, the last row is padding (position max_blocks * bs - 1, past kv_len
    unless max_blocks * bs == kv_len), the others anywhere below kv_len. Each row owns the blocks
    of its keys 0..min(position, kv_len - 1) (the padding row none if ``null_padding``, as the
    engine's), drawn shuffled from 1..num_blocks-1; its other entries are the null block 0. The
    table's extra row is another sequence's (one block, never read). Every block, the null one
    and two unowned ones too, holds random finite values. The static caches are copied block by
    block through the table, the null block wherever it points."""
    g = gen(seed)
    max_blocks = max_blocks or -(-kv_len // bs) + 1
    T = max_blocks * bs
    pos = torch.randint(1, kv_len, (B,), generator=g)
    pos[0], pos[-1] = 0, T - 1
    need = [min(int(p), kv_len - 1) // bs + 1 for p in pos] + [1]
    if null_padding:
        need[B - 1] = 0
    num_blocks = 1 + sum(need) + 2
    ids = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    table = torch.zeros(B + 1, max_blocks, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    q = randn(B, H, Dh, dtype=dtype, g=g)
    kp, vp = (randn(num_blocks, Hkv, bs, Dh, dtype=dtype, g=g) for _ in range(2))
    ks, vs = (torch.empty(B + 1, Hkv, T, Dh, dtype=dtype) for _ in range(2))
    for b in range(B + 1):
        for j in range(max_blocks):
            ks[b, :, j * bs : (j + 1) * bs] = kp[table[b, j]]
            vs[b, :, j * bs : (j + 1) * bs] = vp[table[b, j]]
    return tuple(t.to(device) for t in (q, kp, vp, table, ks, vs, pos))
