"""deployments.kernels: the torch references against plain torch, the fallback and input checks,
the Triton kernels under the Triton interpreter (on CPU), and on CUDA (incl. inside a CUDA graph).

Triton reads TRITON_INTERPRET when it is first imported (its own library functions are
decorated then), so the interpreter cases cannot share a process with compiled kernels:
`test_triton_interpreter` reruns the `test_interp_*` cases of this file in a fresh
process with TRITON_INTERPRET=1 (or run `TRITON_INTERPRET=1 pytest tests/test_kernels.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import gpu
from deployments.kernels import ops, policy

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: tight; fp16/bf16: about 2 ulps (rtol = 2 * eps) with a small atol for values near 0.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
EPS = 1e-6

NORM_SHAPES = [(1, 64), (3, 4096), (3, 4100), (2, 5, 96)]
SILU_SHAPES = [(1, 2 * 64), (3, 2 * 4100), (2, 3, 2 * 11)]
# (B, n_heads, n_kv, head_dim, qkv row padding): MHA, GQA, head_dim 64/128, and 80 (half not a power of 2)
ROPE_CASES = [(1, 4, 4, 64, 0), (3, 8, 2, 128, 16), (3, 6, 2, 64, 8), (2, 4, 2, 80, 0)]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype: torch.dtype, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _norm_inputs(shape, dtype, device="cpu", seed=0, pad=0):
    """x (rows padded when `pad`: a strided row view), residual, weight."""
    g = _gen(seed)
    D = shape[-1]
    x = _randn(*shape[:-1], D + pad, dtype=dtype, g=g, device=device)[..., :D]
    return x, _randn(*shape, dtype=dtype, g=g, device=device), _randn(D, dtype=dtype, g=g, device=device)


def _rope_inputs(B, H, Hkv, Dh, pad, dtype, device="cpu", T=32, slots=None, seed=0):
    """qkv, cos, sign-folded sin, k_cache, v_cache, positions (distinct) and the plain HF sin."""
    g = _gen(seed)
    width = (H + 2 * Hkv) * Dh
    qkv = _randn(B, width + pad, dtype=dtype, g=g, device=device)[:, :width]
    positions = torch.randperm(T, generator=g)[:B].to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, Dh, 2, dtype=torch.float32) / Dh))
    freqs = positions.cpu().float()[:, None] * inv_freq[None]  # [B, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # HF order
    cos, sin = emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)
    h = Dh // 2
    sin_folded = torch.cat((-sin[:, :h], sin[:, h:]), dim=-1)
    k_cache = _randn(slots or B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    v_cache = _randn(slots or B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    return qkv, cos, sin_folded, k_cache, v_cache, positions, sin


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_ref_add_rms_norm(shape, dtype):
    x, r, w = _norm_inputs(shape, dtype, pad=3)
    normed, summed = ops._ref_add_rms_norm(x, r, w, EPS)
    expect_sum = x + r
    assert torch.equal(summed, expect_sum)
    s = expect_sum.double()
    expect = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()).to(dtype)
    assert normed.dtype == dtype and normed.shape == x.shape
    torch.testing.assert_close(normed, expect, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_ref_silu_mul(shape, dtype):
    n = shape[-1] // 2
    gate_up = _randn(*shape[:-1], 2 * n + 5, dtype=dtype, g=_gen())[..., : 2 * n]  # strided rows
    out = ops._ref_silu_mul(gate_up)
    g, u = gate_up[..., :n].double(), gate_up[..., n:].double()
    assert out.dtype == dtype and out.shape == (*shape[:-1], n)
    torch.testing.assert_close(out, (g * torch.sigmoid(g) * u).to(dtype), **TOL[dtype])


def _hf_rope_longhand(qkv, cos, sin, k_cache, v_cache, positions, H, Hkv, Dh):
    """HF's x*cos + rotate_half(x)*sin, head by head in fp64, and the cache writes as plain indexing."""
    def rotate_half(x):
        return torch.cat((-x[Dh // 2:], x[: Dh // 2]))

    q = torch.empty(qkv.shape[0], H, Dh, dtype=qkv.dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    for b in range(qkv.shape[0]):
        c, s, p = cos[b].double(), sin[b].double(), int(positions[b])
        for h in range(H):
            x = qkv[b, h * Dh : (h + 1) * Dh].double()
            q[b, h] = (x * c + rotate_half(x) * s).to(qkv.dtype)
        for j in range(Hkv):
            x = qkv[b, (H + j) * Dh : (H + j + 1) * Dh].double()
            kc[b, j, p] = (x * c + rotate_half(x) * s).to(qkv.dtype)
            vc[b, j, p] = qkv[b, (H + Hkv + j) * Dh : (H + Hkv + j + 1) * Dh]
    return q, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_ref_rope_store_kv(case, dtype):
    B, H, Hkv, Dh, pad = case
    qkv, cos, sin_f, kc, vc, pos, sin = _rope_inputs(B, H, Hkv, Dh, pad, dtype)
    expect_q, expect_k, expect_v = _hf_rope_longhand(qkv, cos, sin, kc, vc, pos, H, Hkv, Dh)
    q = ops._ref_rope_store_kv(qkv, cos, sin_f, kc, vc, pos, H, Hkv, Dh)
    assert q.shape == (B, H, Dh) and q.is_contiguous() and q.dtype == dtype
    torch.testing.assert_close(q, expect_q, **TOL[dtype])
    torch.testing.assert_close(kc, expect_k, **TOL[dtype])
    assert torch.equal(vc, expect_v)


# (B, n_heads, n_kv, head_dim, block_size, kv_len, window) of a paged cache: GQA and MHA, head_dim
# 16/32/64, block sizes 16 and 32 (and 128: several key blocks of the kernel in one cache block),
# kv_len not a whole number of blocks, sliding windows
PAGED_CASES = [(4, 8, 2, 64, 16, 100, 0), (3, 4, 4, 32, 32, 70, 0), (4, 6, 2, 16, 16, 64, 20),
               (3, 4, 1, 32, 32, 96, 40), (3, 4, 4, 16, 128, 200, 0)]


def _paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, device="cpu", seed=0, max_blocks=None, null_padding=False):
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
    g = _gen(seed)
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
    q = _randn(B, H, Dh, dtype=dtype, g=g)
    kp, vp = (_randn(num_blocks, Hkv, bs, Dh, dtype=dtype, g=g) for _ in range(2))
    ks, vs = (torch.empty(B + 1, Hkv, T, Dh, dtype=dtype) for _ in range(2))
    for b in range(B + 1):
        for j in range(max_blocks):
            ks[b, :, j * bs : (j + 1) * bs] = kp[table[b, j]]
            vs[b, :, j * bs : (j + 1) * bs] = vp[table[b, j]]
    return tuple(t.to(device) for t in (q, kp, vp, table, ks, vs, pos))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PAGED_CASES)
def test_ref_rope_store_kv_paged_writes_the_addressed_slot_only(case, dtype):
    """Row b's roped k and its v land at [block_table[b, p // bs], :, p % bs], as the static
    cache gets them at [b, :, p], and nothing else in the caches changes. The padding row's
    entry there is the null block: it writes the null block, never a block another row owns."""
    B, H, Hkv, Dh, bs, kv_len, _ = case
    qkv, cos, sin, *_ = _rope_inputs(B, H, Hkv, Dh, 8, dtype)
    _, kp, vp, table, ks, vs, pos = _paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype)
    assert table[B - 1, int(pos[-1]) // bs] == 0
    want_q = ops._ref_rope_store_kv(qkv, cos, sin, ks, vs, pos, H, Hkv, Dh)
    want_k, want_v = kp.clone(), vp.clone()
    for b, p in enumerate(pos.tolist()):
        want_k[table[b, p // bs], :, p % bs] = ks[b, :, p]
        want_v[table[b, p // bs], :, p % bs] = vs[b, :, p]
    null_before = kp[0].clone()
    q = ops._ref_rope_store_kv(qkv, cos, sin, kp, vp, pos, H, Hkv, Dh, table)
    assert torch.equal(q, want_q)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)
    assert not torch.equal(kp[0], null_before)  # the padding row's write


@pytest.mark.parametrize("position", [64, -1])
def test_ref_rope_store_kv_paged_raises_outside_the_table(position):
    """A position outside [0, max_blocks * block_size) raises (4 blocks of 16 here), as the
    static reference does past T; the caches are not written."""
    B, H, Hkv, Dh = 3, 4, 2, 32
    qkv, cos, sin, *_ = _rope_inputs(B, H, Hkv, Dh, 0, torch.float32)
    _, kp, vp, table, *_ = _paged_inputs(B, H, Hkv, Dh, 16, 40, torch.float32)
    assert table.shape[1] == 4
    before_k, before_v = kp.clone(), vp.clone()
    with pytest.raises(IndexError):
        ops._ref_rope_store_kv(qkv, cos, sin, kp, vp, torch.tensor([5, position, 3]), H, Hkv, Dh, table)
    assert torch.equal(kp, before_k) and torch.equal(vp, before_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("null_padding", [False, True])
@pytest.mark.parametrize("case", PAGED_CASES)
def test_ref_decode_attention_paged_matches_static(case, null_padding, dtype):
    """Through the table, the same result as the static cache holding the same logical keys:
    the same masks (position 0, a window, a padding row, owning blocks or reading only the
    null block), the table's extra row ignored."""
    B, H, Hkv, Dh, bs, kv_len, window = case
    q, kp, vp, table, ks, vs, pos = _paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, null_padding=null_padding)
    want = ops._ref_decode_attention(q, ks, vs, pos, kv_len, window, Dh**-0.5)
    got = ops._ref_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, table)
    assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- public API on CPU


def test_available(monkeypatch):
    monkeypatch.delenv("COLDSTART_TRITON", raising=False)
    assert not ops.available("cpu") and not ops.available(torch.device("cpu"))
    assert ops.available("cuda") == (ops.triton is not None)
    monkeypatch.setenv("COLDSTART_TRITON", "0")
    assert not ops.available("cuda")


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_functions_fall_back_on_cpu(dtype):
    x, r, w = _norm_inputs((3, 4100), dtype)
    normed, summed = ops.add_rms_norm(x, r, w, EPS)
    ref_normed, ref_summed = ops._ref_add_rms_norm(x, r, w, EPS)
    assert torch.equal(normed, ref_normed) and torch.equal(summed, ref_summed)

    gate_up = _randn(3, 2 * 4100, dtype=dtype, g=_gen(1))
    assert torch.equal(ops.silu_mul(gate_up), ops._ref_silu_mul(gate_up))

    qkv, cos, sin, kc, vc, pos, _ = _rope_inputs(3, 8, 2, 128, 16, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    q = ops.rope_store_kv(qkv, cos, sin, kc, vc, pos, 8, 2, 128)
    assert torch.equal(q, ops._ref_rope_store_kv(qkv, cos, sin, kc2, vc2, pos, 8, 2, 128))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)

    q, kp, vp, table, _, _, pos = _paged_inputs(3, 8, 2, 32, 16, 40, dtype)
    kp2, vp2 = kp.clone(), vp.clone()
    qkv, cos, sin, *_ = _rope_inputs(3, 8, 2, 32, 0, dtype)
    q_out = ops.rope_store_kv(qkv, cos, sin, kp, vp, pos, 8, 2, 32, block_table=table)
    assert torch.equal(q_out, ops._ref_rope_store_kv(qkv, cos, sin, kp2, vp2, pos, 8, 2, 32, table))
    assert torch.equal(kp, kp2) and torch.equal(vp, vp2)
    assert torch.equal(ops.decode_attention(q, kp, vp, pos, 40, 0, 0.25, block_table=table),
                       ops._ref_decode_attention(q, kp, vp, pos, 40, 0, 0.25, table))


def _rope_call(**over):
    B, H, Hkv, Dh, T = 2, 2, 1, 4, 5
    args = dict(qkv=torch.randn(B, (H + 2 * Hkv) * Dh), cos=torch.randn(B, Dh), sin=torch.randn(B, Dh),
                k_cache=torch.randn(3, Hkv, T, Dh), v_cache=torch.randn(3, Hkv, T, Dh),
                positions=torch.tensor([0, 4]), n_heads=H, n_kv=Hkv, head_dim=Dh)
    return lambda: ops.rope_store_kv(**{**args, **over})


def _paged_rope_call(**over):
    B, H, Hkv, Dh, bs = 2, 2, 1, 4, 16
    args = dict(qkv=torch.randn(B, (H + 2 * Hkv) * Dh), cos=torch.randn(B, Dh), sin=torch.randn(B, Dh),
                k_cache=torch.randn(3, Hkv, bs, Dh), v_cache=torch.randn(3, Hkv, bs, Dh),
                positions=torch.tensor([0, 20]), n_heads=H, n_kv=Hkv, head_dim=Dh,
                block_table=torch.tensor([[1, 0], [2, 0]], dtype=torch.int32))
    return lambda: ops.rope_store_kv(**{**args, **over})


def _norm_call(x=(2, 8), r=(2, 8), w=(8,), dtype=torch.float32, r_dtype=None, w_dtype=None):
    return lambda: ops.add_rms_norm(torch.randn(x).to(dtype), torch.randn(r).to(r_dtype or dtype),
                                        torch.randn(w).to(w_dtype or dtype), EPS)


BAD_INPUTS = [
    pytest.param(_norm_call(dtype=torch.int64), "x", id="norm-x-int"),
    pytest.param(lambda: ops.add_rms_norm(torch.randn(8, 2).t(), torch.randn(2, 8), torch.randn(8), EPS),
                 "x", id="norm-x-strided-last-dim"),
    pytest.param(_norm_call(r=(2, 9)), "residual", id="norm-residual-shape"),
    pytest.param(_norm_call(r_dtype=torch.float16), "residual", id="norm-residual-dtype"),
    pytest.param(_norm_call(w=(9,)), "weight", id="norm-weight-shape"),
    pytest.param(_norm_call(w_dtype=torch.bfloat16), "weight", id="norm-weight-dtype"),
    pytest.param(lambda: ops.silu_mul(torch.randn(2, 7)), "gate_up", id="silu-odd"),
    pytest.param(lambda: ops.silu_mul([1.0, 2.0]), "gate_up", id="silu-not-tensor"),
    pytest.param(lambda: ops.silu_mul(torch.randn(8, 2).t()), "gate_up", id="silu-strided-last-dim"),
    pytest.param(_rope_call(qkv=torch.randn(2, 15)), "qkv", id="rope-qkv-width"),
    pytest.param(_rope_call(qkv=torch.randn(2, 1, 16)), "qkv", id="rope-qkv-3d"),
    pytest.param(_rope_call(cos=torch.randn(2, 1, 4)), "cos", id="rope-cos-shape"),
    pytest.param(_rope_call(sin=torch.randn(2, 4, dtype=torch.float16)), "sin", id="rope-sin-dtype"),
    pytest.param(_rope_call(k_cache=torch.randn(1, 1, 5, 4)), "k_cache", id="rope-k-cache-slots"),
    pytest.param(_rope_call(k_cache=torch.randn(3, 1, 10, 4)[:, :, ::2]), "k_cache", id="rope-k-cache-strided"),
    pytest.param(_rope_call(v_cache=torch.randn(3, 1, 6, 4)), "v_cache", id="rope-v-cache-shape"),
    pytest.param(_rope_call(positions=torch.tensor([0, 4], dtype=torch.int32)), "positions", id="rope-pos-int32"),
    pytest.param(_rope_call(positions=torch.tensor([0])), "positions", id="rope-pos-shape"),
    pytest.param(_rope_call(positions=[0, 4]), "positions", id="rope-pos-list"),
    pytest.param(_rope_call(head_dim=3, qkv=torch.randn(2, 12)), "head_dim", id="rope-head-dim-odd"),
    pytest.param(_rope_call(n_kv=0), "n_kv", id="rope-n-kv-zero"),
    pytest.param(_paged_rope_call(block_table=torch.tensor([[1, 0], [2, 0]])), "block_table",
                 id="paged-rope-table-int64"),
    pytest.param(_paged_rope_call(block_table=torch.tensor([1, 2], dtype=torch.int32)), "block_table",
                 id="paged-rope-table-1d"),
    pytest.param(_paged_rope_call(block_table=torch.tensor([[1, 0]], dtype=torch.int32)), "block_table",
                 id="paged-rope-table-rows"),
    pytest.param(_paged_rope_call(block_table=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]), "block_table",
                 id="paged-rope-table-strided"),
    pytest.param(_paged_rope_call(block_table=torch.zeros(2, 2, dtype=torch.int32, device="meta")), "block_table",
                 id="paged-rope-table-device"),
    pytest.param(_paged_rope_call(block_table=[[1, 0], [2, 0]]), "block_table", id="paged-rope-table-list"),
    pytest.param(_paged_rope_call(k_cache=torch.randn(3, 1, 8, 4), v_cache=torch.randn(3, 1, 8, 4)), "k_cache",
                 id="paged-rope-block-size-8"),
    pytest.param(_paged_rope_call(k_cache=torch.randn(3, 1, 24, 4), v_cache=torch.randn(3, 1, 24, 4)), "k_cache",
                 id="paged-rope-block-size-24"),
    pytest.param(_paged_rope_call(k_cache=torch.randn(3, 2, 16, 4)), "k_cache", id="paged-rope-k-cache-n-kv"),
    pytest.param(_paged_rope_call(v_cache=torch.randn(4, 1, 16, 4)), "v_cache", id="paged-rope-v-cache-shape"),
]


@pytest.mark.parametrize("call, name", BAD_INPUTS)
def test_bad_inputs_raise_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()


def test_paged_rope_call_is_valid():
    """The paged cases above change one argument of a call that passes (row 1 writes the null block)."""
    assert _paged_rope_call()().shape == (2, 2, 4)


# ----------------------------------------------------------------------------- Triton interpreter


@pytest.fixture
def interp():
    """kernels.ops, with its Triton kernels interpreted (only in a TRITON_INTERPRET=1 process)."""
    pytest.importorskip("triton")
    if not INTERPRETED:
        pytest.skip("runs in a TRITON_INTERPRET=1 process (test_triton_interpreter)")
    return ops


def test_triton_interpreter():
    """Reruns this file's test_interp_* cases in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_", __file__],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and "skipped" not in summary, proc.stdout[-6000:] + proc.stderr[-3000:]


def _assert_rounded_like_torch(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal, except that the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): 1 ulp."""
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_interp_add_rms_norm(interp, shape, dtype):
    x, r, w = _norm_inputs(shape, dtype, pad=5)
    normed, summed = interp._launch_add_rms_norm(x, r, w, EPS)
    ref_normed, ref_summed = interp._ref_add_rms_norm(x, r, w, EPS)
    assert normed.shape == summed.shape == x.shape and normed.is_contiguous() and summed.is_contiguous()
    _assert_rounded_like_torch(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_interp_silu_mul(interp, shape, dtype):
    n = shape[-1] // 2
    gate_up = _randn(*shape[:-1], 2 * n + 7, dtype=dtype, g=_gen(2))[..., : 2 * n]
    out = interp._launch_silu_mul(gate_up)
    assert out.shape == (*shape[:-1], n) and out.dtype == dtype
    torch.testing.assert_close(out, interp._ref_silu_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_interp_rope_store_kv(interp, case, dtype):
    B, H, Hkv, Dh, pad = case
    qkv, cos, sin, kc, vc, pos, _ = _rope_inputs(B, H, Hkv, Dh, pad, dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    q = interp._launch_rope_store_kv(qkv, cos, sin, kc, vc, pos, H, Hkv, Dh)
    ref_q = interp._ref_rope_store_kv(qkv, cos, sin, ref_kc, ref_vc, pos, H, Hkv, Dh)
    assert q.shape == (B, H, Dh) and q.is_contiguous()
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(kc, ref_kc, **TOL[dtype])  # written rows close, the rest untouched
    assert torch.equal(vc, ref_vc)


def test_interp_rope_skips_out_of_range_position(interp):
    qkv, cos, sin, kc, vc, _, _ = _rope_inputs(2, 4, 2, 64, 0, torch.float32, T=8)
    before_k, before_v = kc.clone(), vc.clone()
    interp._launch_rope_store_kv(qkv, cos, sin, kc, vc, torch.tensor([3, 8]), 4, 2, 64)
    assert torch.equal(kc[1:], before_k[1:]) and torch.equal(vc[1:], before_v[1:])  # row 1: position 8 >= T
    assert not torch.equal(kc[0, :, 3], before_k[0, :, 3]) and torch.equal(vc[0, :, 3], qkv[0, 384:].view(2, 64))


# (B, n_heads, n_kv, head_dim, T, kv_len, window): MHA, GQA, a kv_len that is not a whole
# number of key blocks, a sliding window, a padding row (position >= kv_len)
ATTN_CASES = [(1, 4, 4, 64, 256, 200, 0), (3, 8, 2, 128, 512, 512, 0), (2, 6, 2, 16, 96, 70, 24),
              (3, 4, 1, 32, 1024, 1000, 0), (2, 4, 4, 32, 128, 100, 16)]


def _attn_inputs(B, H, Hkv, Dh, T, kv_len, dtype, device="cpu", seed=0):
    g = _gen(seed)
    q = _randn(B, H, Dh, dtype=dtype, g=g, device=device)
    kc = _randn(B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    vc = _randn(B + 1, Hkv, T, Dh, dtype=dtype, g=g, device=device)
    pos = torch.randint(0, kv_len, (B,), generator=g)
    pos[-1] = T - 1  # the engine's padding rows sit at the last position: they see every key
    return q, kc, vc, pos.to(device)


# Triton's interpreter computes a bf16 tl.dot wrongly (a 16x16 product is off by ~1e10),
# so the attention (tensor-core dots) runs in bf16 only on the GPU
# (test_gpu_decode_attention_matches_reference).
@pytest.mark.parametrize("case, dtype", [(c, d) for c in ATTN_CASES for d in DTYPES if d != torch.bfloat16])
def test_interp_decode_attention(interp, case, dtype):
    B, H, Hkv, Dh, T, kv_len, window = case
    q, kc, vc, pos = _attn_inputs(B, H, Hkv, Dh, T, kv_len, dtype)
    out = interp._launch_decode_attention(q, kc, vc, pos, kv_len, window, Dh**-0.5)
    ref = interp._ref_decode_attention(q, kc, vc, pos, kv_len, window, Dh**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **({} if dtype == torch.float32 else TOL[dtype]))


@pytest.mark.parametrize("Hkv", [4, 1])
def test_interp_decode_attention_short_rows_in_a_long_bound(interp, Hkv):
    """One CUDA graph per batch size launches with kv_len = the whole cache: each row cuts its
    own keys (up to its position) into the slices, so a row at position 0, one a few blocks in,
    one across many slices and a padding row all come out as the reference has them, and the
    keys past each row's position (NaN here) are never read."""
    B, H, Dh, T = 4, 4, 32, 1024
    q, kc, vc, _ = _attn_inputs(B, H, Hkv, Dh, T, T, torch.float32)
    pos = torch.tensor([0, 70, 900, T - 1])
    stale_k, stale_v = kc.clone(), vc.clone()
    for b in range(B - 1):
        stale_k[b, :, int(pos[b]) + 1:] = float("nan")
        stale_v[b, :, int(pos[b]) + 1:] = float("nan")
    out = interp._launch_decode_attention(q, stale_k, stale_v, pos, T, 0, Dh**-0.5)
    torch.testing.assert_close(out, interp._ref_decode_attention(q, kc, vc, pos, T, 0, Dh**-0.5))


@pytest.mark.parametrize("case", [c for c in ATTN_CASES if not c[6] and c[0] > 1])
def test_interp_decode_attention_reads_no_key_past_the_position(interp, case):
    """Keys and values past a row's position (a freed slot's stale ones, say) are never read:
    NaN there changes nothing. Only the padding row, which sees every key, keeps its clean ones."""
    B, H, Hkv, Dh, T, kv_len, window = case
    q, kc, vc, pos = _attn_inputs(B, H, Hkv, Dh, T, kv_len, torch.float32)
    stale_k, stale_v = kc.clone(), vc.clone()
    for b in range(B - 1):
        stale_k[b, :, int(pos[b]) + 1:] = float("nan")
        stale_v[b, :, int(pos[b]) + 1:] = float("nan")
    out = interp._launch_decode_attention(q, stale_k, stale_v, pos, kv_len, window, Dh**-0.5)
    torch.testing.assert_close(out, interp._ref_decode_attention(q, kc, vc, pos, kv_len, window, Dh**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PAGED_CASES)
def test_interp_rope_store_kv_paged(interp, case, dtype):
    """As the paged reference: each row's slot written (the padding row's in the null block), the rest untouched."""
    B, H, Hkv, Dh, bs, kv_len, _ = case
    qkv, cos, sin, *_ = _rope_inputs(B, H, Hkv, Dh, 8, dtype)
    _, kp, vp, table, _, _, pos = _paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype)
    ref_k, ref_v = kp.clone(), vp.clone()
    q = interp._launch_rope_store_kv(qkv, cos, sin, kp, vp, pos, H, Hkv, Dh, table)
    ref_q = interp._ref_rope_store_kv(qkv, cos, sin, ref_k, ref_v, pos, H, Hkv, Dh, table)
    assert q.shape == (B, H, Dh) and q.is_contiguous()
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(kp, ref_k, **TOL[dtype])  # written slots close, the rest untouched
    assert torch.equal(vp, ref_v)


def test_interp_rope_paged_skips_positions_outside_the_table(interp):
    """Rows at positions 64 (= max_blocks * block_size) and -1 write nothing; row 0 its slot."""
    B, H, Hkv, Dh, bs = 3, 4, 2, 32, 16
    qkv, cos, sin, *_ = _rope_inputs(B, H, Hkv, Dh, 0, torch.float32)
    _, kp, vp, table, *_ = _paged_inputs(B, H, Hkv, Dh, bs, 40, torch.float32)
    assert table.shape[1] * bs == 64
    want_k, want_v = kp.clone(), vp.clone()
    interp._launch_rope_store_kv(qkv, cos, sin, kp, vp, torch.tensor([5, 64, -1]), H, Hkv, Dh, table)
    blk = int(table[0, 0])
    assert not torch.equal(kp[blk, :, 5], want_k[blk, :, 5])
    want_k[blk, :, 5] = kp[blk, :, 5]
    want_v[blk, :, 5] = qkv[0, (H + Hkv) * Dh :].view(Hkv, Dh)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)


# bf16 left out as in test_interp_decode_attention (the interpreter's bf16 tl.dot)
@pytest.mark.parametrize("block_n", [None, 16])
@pytest.mark.parametrize("null_padding", [False, True])
@pytest.mark.parametrize("case, dtype", [(c, d) for c in PAGED_CASES for d in DTYPES if d != torch.bfloat16])
def test_interp_decode_attention_paged(interp, case, dtype, null_padding, block_n):
    """As the paged reference; and, with the same key blocks (BLOCK_N = min(block_n, block_size)),
    the very result of the static kernel over the same logical keys."""
    B, H, Hkv, Dh, bs, kv_len, window = case
    q, kp, vp, table, ks, vs, pos = _paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, null_padding=null_padding)
    out = interp._launch_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, block_n, block_table=table)
    ref = interp._ref_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, table)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **({} if dtype == torch.float32 else TOL[dtype]))
    static_n = min(block_n or interp._ATTN_DEFAULTS[0], bs)
    assert torch.equal(out, interp._launch_decode_attention(q, ks, vs, pos, kv_len, window, Dh**-0.5, static_n))


@pytest.mark.parametrize("case", PAGED_CASES + [(4, 4, 2, 32, 16, 256, 0)])
def test_interp_decode_attention_paged_reads_no_key_past_the_position(interp, case):
    """Only the blocks of a row's keys up to its position (up to kv_len for the padding row)
    are read: NaN in the rest of each row's last block and in every block no row reads (another
    sequence's, unowned ones) changes nothing. The last case's kv_len is the whole table
    (max_blocks * block_size), its rows short ones in that bound."""
    B, H, Hkv, Dh, bs, kv_len, window = case
    max_blocks = kv_len // bs if kv_len == 256 else None
    q, kp, vp, table, *_, pos = _paged_inputs(B, H, Hkv, Dh, bs, kv_len, torch.float32, max_blocks=max_blocks)
    want = interp._ref_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, table)
    stale_k, stale_v = kp.clone(), vp.clone()
    for b in range(B):
        last = min(int(pos[b]), kv_len - 1)
        blk = int(table[b, last // bs])
        stale_k[blk, :, last % bs + 1 :] = float("nan")
        stale_v[blk, :, last % bs + 1 :] = float("nan")
    unread = sorted(set(range(1, kp.shape[0])) - set(table[:B].flatten().tolist()))
    assert len(unread) >= 3  # another sequence's block and two unowned ones
    stale_k[unread] = float("nan")
    stale_v[unread] = float("nan")
    out = interp._launch_decode_attention(q, stale_k, stale_v, pos, kv_len, window, Dh**-0.5, block_table=table)
    torch.testing.assert_close(out, want)


# (N, K, bias): N not a multiple of the row block, K not a multiple of the K block, a bias
GEMV_CASES = [(64, 128, False), (37, 100, True), (96, 1100, False), (5, 16, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMV_CASES)
def test_interp_gemv(interp, case, dtype):
    N, K, has_bias = case
    g = _gen(3)
    x, w = _randn(1, K, dtype=dtype, g=g), _randn(N, K + 8, dtype=dtype, g=g)[:, :K]  # strided rows
    b = _randn(N, dtype=dtype, g=g) if has_bias else None
    for blocks in ((4, 512, 4), (1, 64, 2), (8, 32, 4)):
        out = interp._launch_gemv(x, w, b, blocks)
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
        assert out.shape == (1, N) and out.dtype == dtype
        # fp32: another summation order than torch's, so a few ulps of the sum
        torch.testing.assert_close(out, want, **(dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32
                                                 else TOL[dtype]))


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("mistral", {"sliding_window": 5})])
def test_interp_engine_path_gives_transformers_greedy_tokens(interp, monkeypatch, tmp_path, arch, kw):
    """The whole fused decode path (all four kernels, interpreted) inside the engine."""
    from deployments.engine import Engine, EngineConfig, SamplingParams
    from deployments.model import build_model
    from helpers_engine import hf_greedy, hf_model
    from weights import PackOptions, load, pack

    import dataclasses

    from deployments.model.build import gemv_groups

    monkeypatch.setattr(interp, "available", lambda device: True)
    hf, cfg = hf_model(arch, **kw)
    hf.save_pretrained(tmp_path / "hf")
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    # every projection through the GEMV: qkv, o_proj, gate_up, down_proj, lm_head (o_proj and q share a shape)
    shapes = frozenset(tuple(pairs[0][0].shape) for pairs in gemv_groups(model).values())
    model.kernels = dataclasses.replace(model.kernels, fused=True, attention=True, gemv=shapes)
    D, V = model.config.hidden_size, model.config.vocab_size
    assert {(D, D), (V, D)} <= model.kernels.gemv
    eng = Engine(model, None, EngineConfig(max_slots=2, max_seq_len=64, prefill_chunk=4))
    eng.start()
    try:
        prompts = [[3, 5, 7, 11, 13], [9] * 7]
        hs = [eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts]
        for p, h in zip(prompts, hs):
            assert h.result(timeout=120)[0] == hf_greedy(hf, p, 10)
    finally:
        eng.shutdown()


# ----------------------------------------------------------------------------- CUDA


def _use_triton(monkeypatch) -> None:
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1: compiled kernels are not available in this process")
    monkeypatch.delenv("COLDSTART_TRITON", raising=False)
    assert ops.available("cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3, 64])
def test_gpu_kernels_match_reference(monkeypatch, B, dtype):
    _use_triton(monkeypatch)
    x, r, w = _norm_inputs((B, 4096), dtype, device="cuda", pad=64)
    normed, summed = ops.add_rms_norm(x, r, w, EPS)
    ref_normed, ref_summed = ops._ref_add_rms_norm(x, r, w, EPS)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])

    gate_up = _randn(B, 2 * 14336 + 64, dtype=dtype, g=_gen(3), device="cuda")[:, : 2 * 14336]
    torch.testing.assert_close(ops.silu_mul(gate_up), ops._ref_silu_mul(gate_up), **TOL[dtype])

    qkv, cos, sin, kc, vc, pos, _ = _rope_inputs(B, 32, 8, 128, 64, dtype, device="cuda", T=128, slots=80)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    q = ops.rope_store_kv(qkv, cos, sin, kc, vc, pos, 32, 8, 128)
    ref_q = ops._ref_rope_store_kv(qkv, cos, sin, ref_kc, ref_vc, pos, 32, 8, 128)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(kc, ref_kc, **TOL[dtype])
    assert torch.equal(vc, ref_vc)


def _captured(step):
    """``step`` run once on a side stream (its kernels compile there, off the capture, as torch's
    docs do), then captured: (the graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernels_in_cuda_graph(monkeypatch, dtype):
    _use_triton(monkeypatch)
    B, D, n, H, Hkv, Dh, T = 4, 4096, 1024, 8, 2, 128, 64
    x, r, w = _norm_inputs((B, D), dtype, device="cuda")
    gate_up = _randn(B, 2 * n, dtype=dtype, g=_gen(4), device="cuda")
    qkv, cos, sin, kc, vc, pos, _ = _rope_inputs(B, H, Hkv, Dh, 0, dtype, device="cuda", T=T)

    def step():
        return ops.add_rms_norm(x, r, w, EPS), ops.silu_mul(gate_up), \
            ops.rope_store_kv(qkv, cos, sin, kc, vc, pos, H, Hkv, Dh)

    graph, ((normed, summed), act, q) = _captured(step)

    for seed in (10, 11):  # new inputs and positions each replay
        x2, r2, _ = _norm_inputs((B, D), dtype, device="cuda", seed=seed)
        x.copy_(x2), r.copy_(r2)
        gate_up.copy_(_randn(B, 2 * n, dtype=dtype, g=_gen(seed), device="cuda"))
        new = _rope_inputs(B, H, Hkv, Dh, 0, dtype, device="cuda", T=T, seed=seed)
        for dst, src in zip((qkv, cos, sin, pos), (new[0], new[1], new[2], new[5])):
            dst.copy_(src)
        ref_kc, ref_vc = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_normed, ref_summed = ops._ref_add_rms_norm(x, r, w, EPS)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
        torch.testing.assert_close(act, ops._ref_silu_mul(gate_up), **TOL[dtype])
        ref_q = ops._ref_rope_store_kv(qkv, cos, sin, ref_kc, ref_vc, pos, H, Hkv, Dh)
        torch.testing.assert_close(q, ref_q, **TOL[dtype])
        torch.testing.assert_close(kc, ref_kc, **TOL[dtype])
        assert torch.equal(vc, ref_vc)


@pytest.mark.parametrize("kw, msg", [
    (dict(x=torch.zeros(2, 8)), "one row"), (dict(w=torch.zeros(4, 9)), "one row"),
    (dict(w=torch.zeros(4, 8, dtype=torch.float16)), "^w must match"),
    (dict(bias=torch.zeros(5)), "^bias must be"), (dict(x=torch.zeros(1, 8, dtype=torch.int64)), "^x must be"),
])
def test_gemv_rejects_bad_inputs(kw, msg):
    args = dict(x=torch.zeros(1, 8), w=torch.zeros(4, 8), bias=None)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        ops.gemv(**args)


def test_gemv_falls_back_on_cpu():
    g = _gen(5)
    x, w, b = _randn(1, 1, 24, dtype=torch.float32, g=g), _randn(7, 24, dtype=torch.float32, g=g), \
        _randn(7, dtype=torch.float32, g=g)
    assert torch.equal(ops.gemv(x, w, b), torch.nn.functional.linear(x, w, b))
    chosen, report = policy.gemv_choice({"proj": [(w, b)]})
    assert chosen == set() and "not available" in report["proj"]["error"]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N, K", [(4096, 4096), (12288, 4096), (4096, 11008), (32000, 4096), (1000, 300)])
def test_gpu_gemv_matches_linear_and_is_timed(monkeypatch, N, K, dtype):
    _use_triton(monkeypatch)
    g = _gen(6)
    x, w = _randn(1, K, dtype=dtype, g=g, device="cuda"), _randn(N, K, dtype=dtype, g=g, device="cuda")
    b = _randn(N, dtype=dtype, g=g, device="cuda")
    want = torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype)
    torch.testing.assert_close(ops.gemv(x, w, b), want, **TOL[dtype])
    chosen, report = policy.gemv_choice({"proj": [(w, b), (w, b)]})
    r = report["proj"]
    assert "error" not in r and r["torch_ms"] > 0 and r["triton_ms"] > 0
    assert (chosen == {(N, K)}) == r["triton"]


def test_gemv_choice_keeps_nothing_without_cuda(tmp_path):
    w = torch.zeros(8, 16)
    chosen, report = policy.gemv_choice({"proj": [(w, None)]}, keep=tmp_path)
    assert chosen == set() and "not available" in report["proj"]["error"]
    assert list(tmp_path.iterdir()) == []


def test_kernel_verdicts_round_trip_and_survive_bad_files(tmp_path, caplog):
    path = tmp_path / "sub" / "coldstart-gemv-x.json"
    assert policy._read_verdict(path) is None  # none yet
    report = {"qkv": {"shape": [12288, 4096], "torch_ms": 0.9, "triton_ms": 0.8, "triton": True}}
    policy._write_verdict(path, {"chosen": [[12288, 4096]], "report": report})
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    chosen, got = policy._cached_gemv_choice(policy._read_verdict(path), ["qkv"])
    assert chosen == {(12288, 4096)} and got["qkv"] == dict(report["qkv"], cached=True)
    # a verdict for other projections, or a torn file, is judged again (None), never trusted
    assert policy._cached_gemv_choice(policy._read_verdict(path), ["qkv", "o_proj"]) is None
    path.write_text('{"chosen": [[12288, 40')
    assert policy._read_verdict(path) is None and "judging again" in caplog.text
    assert policy._cached_gemv_choice({"chosen": "all", "report": {}}, ["qkv"]) is None


def test_kernel_verdict_that_cannot_be_written_is_not_kept(tmp_path, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    caplog.set_level("INFO")
    policy._write_verdict(blocker / "coldstart-gemv-x.json", {"chosen": [], "report": {}})  # no exception
    assert "not kept" in caplog.text and blocker.read_text().startswith("a file")
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_verdict_dir_follows_tritons_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert policy.verdict_dir() == tmp_path
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert policy.verdict_dir() == tmp_path / ".triton" / "cache"


@gpu
def test_gpu_gemv_choice_is_kept_and_found_again(monkeypatch, tmp_path):
    """The second start with the same shapes takes the first one's verdict (not timed again);
    other shapes, or another margin, are judged anew."""
    _use_triton(monkeypatch)
    w = torch.randn(4096, 4096, dtype=torch.float16, device="cuda")
    first, r1 = policy.gemv_choice({"proj": [(w, None), (w, None)]}, keep=tmp_path)
    files = list(tmp_path.glob("coldstart-gemv-*.json"))
    assert len(files) == 1 and "cached" not in r1["proj"]
    timed = []
    monkeypatch.setattr(policy, "graph_ms", lambda *a, **k: timed.append(1) or 1.0)
    again, r2 = policy.gemv_choice({"proj": [(w, None), (w, None)]}, keep=tmp_path)
    assert again == first and r2["proj"]["cached"] and r2["proj"]["torch_ms"] == r1["proj"]["torch_ms"]
    assert timed == []
    policy.gemv_choice({"proj": [(w, None)]}, keep=tmp_path)  # one layer: another verdict
    policy.gemv_choice({"proj": [(w, None), (w, None)]}, margin=0.5, keep=tmp_path)
    assert timed and len(list(tmp_path.glob("coldstart-gemv-*.json"))) == 3


@gpu
def test_gpu_gemv_choice_never_reads_the_weights(monkeypatch):
    """A replica chooses while its weights are still arriving: NaN weights get the same
    verdict path (a timing, not an error)."""
    _use_triton(monkeypatch)
    w = torch.full((4096, 4096), float("nan"), dtype=torch.float16, device="cuda")
    chosen, report = policy.gemv_choice({"proj": [(w, None), (w, None)]})
    r = report["proj"]
    assert "error" not in r and r["torch_ms"] > 0 and r["triton_ms"] > 0
    assert (chosen == {(4096, 4096)}) == r["triton"]


@gpu
def test_gpu_self_tests_pass_at_7b_sizes(monkeypatch):
    _use_triton(monkeypatch)
    dims = (4096, 11008, 32, 32, 128)
    times: dict[str, float] = {}
    assert policy.self_test(*dims, torch.float16, "cuda", times) is None
    assert set(times) == {"triton", "torch"} and min(times.values()) > 0, times
    times.clear()
    assert policy.attention_self_test(*dims[2:], torch.float16, "cuda", times) is None
    assert set(times) == {"triton", "torch"} and min(times.values()) > 0, times


@gpu
def test_gpu_self_tests_passed_once_are_not_run_again_on_the_node(monkeypatch, tmp_path):
    _use_triton(monkeypatch)
    dims = (256, 512, 4, 2, 64)
    for first in (True, False):
        times: dict[str, float] = {}
        assert policy.self_test(*dims, torch.float16, "cuda", times, keep=tmp_path) is None
        assert policy.attention_self_test(*dims[2:], torch.float16, "cuda", times, keep=tmp_path) is None
        assert ("triton" in times) == first, times  # the second start compares nothing
    assert len(list(tmp_path.glob("coldstart-selftest-*.json"))) == 2
    # other sizes are another verdict: tested
    times = {}
    assert policy.self_test(512, 512, 4, 2, 64, torch.float16, "cuda", times, keep=tmp_path) is None
    assert "triton" in times


def test_kept_test_keeps_a_pass_never_a_failure(tmp_path, caplog):
    path = tmp_path / "coldstart-selftest-x.json"
    runs = []

    def failing() -> str:
        runs.append("f")
        return "silu_mul differs from the torch reference by up to 0.5"

    def passing() -> None:
        runs.append("p")
    assert policy.kept_test(path, failing) == "silu_mul differs from the torch reference by up to 0.5"
    assert not path.exists()  # a failure is tested again at the next start
    assert policy.kept_test(path, failing) is not None and runs == ["f", "f"]
    assert policy.kept_test(path, passing) is None and path.exists()
    assert policy.kept_test(path, failing) is None and runs == ["f", "f", "p"]  # kept: not run
    path.write_text("{not json")  # torn: tested again and rewritten
    assert policy.kept_test(path, passing) is None and runs[-1] == "p" and "judging again" in caplog.text
    assert json.loads(path.read_text()) == {"passed": True}
    path.write_text('{"passed": false}')  # anything but a pass is no verdict
    assert policy.kept_test(path, failing) is not None and runs[-1] == "f"
    assert policy.kept_test(None, passing) is None and runs[-1] == "p"  # nowhere to keep: always run


def test_self_test_says_why_without_cuda():
    why = policy.self_test(64, 96, 4, 2, 16, torch.float32, "cpu")
    assert why is not None and "not available" in why


@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_reference_matches_the_models_attention(window):
    """The reference equals the model's batched-matmul decode attention (the torch path)."""
    from deployments.model.attention import Attention
    from deployments.model.config import ModelConfig

    B, H, Hkv, Dh, T, L = 3, 8, 2, 16, 40, 32
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": H * Dh,
                               "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": H,
                               "num_key_value_heads": Hkv, "vocab_size": 8, "max_position_embeddings": T})
    with torch.device("meta"):
        attn = Attention(cfg, 0)
    q, kc, vc, pos = _attn_inputs(B, H, Hkv, Dh, T, L, torch.float32)
    pos[-1] = L - 1
    k_pos = torch.arange(L)
    allowed = (k_pos <= pos[:, None]) & ((k_pos > pos[:, None] - window) if window else True)
    mask = torch.zeros(B, 1, 1, L).masked_fill(~allowed.view(B, 1, 1, L), float("-inf"))
    mask = mask.expand(B, Hkv, H // Hkv, L).reshape(-1, H // Hkv, L)
    want = attn._decode_attn(q.view(B, H, 1, Dh), kc[:B, :, :L], vc[:B, :, :L], mask).view(B, H, Dh)
    got = ops.decode_attention(q, kc, vc, pos, L, window, Dh**-0.5)  # CPU: the reference
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, msg", [
    (dict(kv_len=0), "kv_len must be an int in"),
    (dict(window=-1), "window must be an int >= 0"),
    (dict(positions=torch.zeros(3, dtype=torch.int32)), "positions must be an int64 tensor"),
    (dict(q=torch.zeros(3, 4, 24)), "head_dim must be a power of two"),
    (dict(q=torch.zeros(3, 5, 16)), "not a multiple of the cache's n_kv"),
])
def test_decode_attention_rejects_bad_inputs(kw, msg):
    args = dict(q=torch.zeros(3, 4, 16), k_cache=torch.zeros(4, 2, 32, 16), v_cache=torch.zeros(4, 2, 32, 16),
                positions=torch.zeros(3, dtype=torch.int64), kv_len=32, window=0, scale=0.25)
    args.update(kw)
    if args["q"].shape[-1] != 16:
        args["k_cache"] = args["v_cache"] = torch.zeros(4, 2, 32, args["q"].shape[-1])
    with pytest.raises(ValueError, match=msg):
        ops.decode_attention(**args)


@pytest.mark.parametrize("kw, msg", [
    (dict(), None),
    (dict(kv_len=65), r"^kv_len must be an int in \[1, 64\] \(max_blocks \* block_size\)"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), r"^block_table must be an int32 tensor \[rows >= 3"),
    (dict(block_table=torch.zeros(12, dtype=torch.int32)), "^block_table must be an int32 tensor"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)), "^block_table must be an int32 tensor"),
    (dict(block_table=torch.zeros(3, 8, dtype=torch.int32)[:, ::2]), "^block_table must be contiguous"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32, device="meta")), "^block_table must be on q's device"),
    (dict(block_table=[[1, 2]] * 3), "^block_table must be an int32 tensor"),
    (dict(k_cache=torch.zeros(9, 2, 8, 16), v_cache=torch.zeros(9, 2, 8, 16)),
     r"^k_cache's block_size \(dim 2\) must be a power of two >= 16, got 8"),
    (dict(k_cache=torch.zeros(6, 2, 24, 16), v_cache=torch.zeros(6, 2, 24, 16)), "^k_cache's block_size"),
    (dict(k_cache=torch.zeros(5, 2, 16, 32)), r"^k_cache must be a contiguous paged cache \[num_blocks, n_kv, "),
    (dict(v_cache=torch.zeros(6, 2, 16, 16)), "^v_cache must have k_cache's shape"),
])
def test_decode_attention_paged_rejects_bad_inputs(kw, msg):
    """The paged layout's checks; the first case (kv_len = max_blocks * block_size) passes."""
    args = dict(q=torch.zeros(3, 4, 16), k_cache=torch.zeros(5, 2, 16, 16), v_cache=torch.zeros(5, 2, 16, 16),
                positions=torch.zeros(3, dtype=torch.int64), kv_len=64, window=0, scale=0.25,
                block_table=torch.zeros(3, 4, dtype=torch.int32))
    args.update(kw)
    if msg is None:
        assert ops.decode_attention(**args).shape == (3, 4, 16)
        return
    with pytest.raises(ValueError, match=msg):
        ops.decode_attention(**args)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ATTN_CASES + [(1, 32, 32, 128, 4096, 4096, 0), (16, 32, 8, 128, 2048, 2048, 0),
                                  (16, 32, 32, 128, 4096, 4096, 0)])
def test_gpu_decode_attention_matches_reference(monkeypatch, case, dtype):
    _use_triton(monkeypatch)
    B, H, Hkv, Dh, T, kv_len, window = case
    q, kc, vc, pos = _attn_inputs(B, H, Hkv, Dh, T, kv_len, dtype, device="cuda")
    out = ops.decode_attention(q, kc, vc, pos, kv_len, window, Dh**-0.5)
    ref = ops._ref_decode_attention(q, kc, vc, pos, kv_len, window, Dh**-0.5)
    torch.testing.assert_close(out, ref, **TOL[dtype])


# (B, n_heads, n_kv, head_dim, block_size, kv_len, window): the test cases, then a 7B's shapes
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", PAGED_CASES + [(16, 32, 8, 128, 16, 2048, 0), (16, 32, 32, 128, 32, 1000, 0),
                                                (4, 32, 8, 128, 64, 4096, 1024), (3, 32, 32, 128, 256, 4096, 0)])
def test_gpu_paged_kernels_match_reference(monkeypatch, case, dtype):
    _use_triton(monkeypatch)
    B, H, Hkv, Dh, bs, kv_len, window = case
    q, kp, vp, table, ks, vs, pos = _paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, device="cuda")
    out = ops.decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, block_table=table)
    torch.testing.assert_close(out, ops._ref_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, table),
                               **TOL[dtype])
    torch.testing.assert_close(out, ops.decode_attention(q, ks, vs, pos, kv_len, window, Dh**-0.5), **TOL[dtype])
    qkv, cos, sin, *_ = _rope_inputs(B, H, Hkv, Dh, 8, dtype, device="cuda")
    ref_k, ref_v = kp.clone(), vp.clone()
    q2 = ops.rope_store_kv(qkv, cos, sin, kp, vp, pos, H, Hkv, Dh, block_table=table)
    ref_q = ops._ref_rope_store_kv(qkv, cos, sin, ref_k, ref_v, pos, H, Hkv, Dh, table)
    torch.testing.assert_close(q2, ref_q, **TOL[dtype])
    torch.testing.assert_close(kp, ref_k, **TOL[dtype])
    assert torch.equal(vp, ref_v)


@gpu
@pytest.mark.parametrize("bs", [16, 32])
def test_gpu_paged_kernels_in_cuda_graph(monkeypatch, bs):
    """One graph serves a new block table, positions and inputs at each replay (no host syncs)."""
    _use_triton(monkeypatch)
    B, H, Hkv, Dh, kv_len, dtype = 4, 8, 2, 64, 200, torch.float16
    max_blocks = -(-kv_len // bs) + 1
    num_blocks = 1 + B * max_blocks
    kp, vp = (_randn(num_blocks, Hkv, bs, Dh, dtype=dtype, g=_gen(i), device="cuda") for i in range(2))
    table = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    q = torch.zeros(B, H, Dh, dtype=dtype, device="cuda")
    qkv, cos, sin, *_ = _rope_inputs(B, H, Hkv, Dh, 0, dtype, device="cuda")

    def step():
        q_out = ops.rope_store_kv(qkv, cos, sin, kp, vp, pos, H, Hkv, Dh, block_table=table)
        return q_out, ops.decode_attention(q, kp, vp, pos, kv_len, 0, Dh**-0.5, block_table=table)

    graph, (q_out, out) = _captured(step)

    for seed in (20, 21):  # every row's blocks distinct (a shuffle of 1..num_blocks-1), the last row padding
        g = _gen(seed)
        table.copy_((1 + torch.randperm(num_blocks - 1, generator=g)).view(B, max_blocks))
        new_pos = torch.randint(0, kv_len, (B,), generator=g)
        new_pos[-1] = max_blocks * bs - 1
        pos.copy_(new_pos)
        q.copy_(_randn(B, H, Dh, dtype=dtype, g=g))
        qkv.copy_(_randn(*qkv.shape, dtype=dtype, g=g))
        ref_k, ref_v = kp.clone(), vp.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_q = ops._ref_rope_store_kv(qkv, cos, sin, ref_k, ref_v, pos, H, Hkv, Dh, table)
        torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
        torch.testing.assert_close(kp, ref_k, **TOL[dtype])
        assert torch.equal(vp, ref_v)
        # the attention ran after the write: its reference reads the written caches
        torch.testing.assert_close(out, ops._ref_decode_attention(q, kp, vp, pos, kv_len, 0, Dh**-0.5, table),
                                   **TOL[dtype])


def test_attention_self_test_says_why():
    assert "not available" in policy.attention_self_test(4, 2, 16, torch.float32, "cpu")


def test_triton_setup_fills_tritons_per_process_caches():
    """The side thread computes what Triton's first compile needs before it can look in its
    cache (the hash of its own library), without patching Triton. In a process of its own: the
    test process does not import Triton."""
    pytest.importorskip("triton")
    code = ("from deployments.startup import triton_setup; t = triton_setup.start('cuda').wait(); "
            "from triton.runtime.cache import triton_key; "
            "print(t.name, t.done(), triton_key.cache_info().currsize, triton_key.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["triton-setup", "True", "1", "triton.runtime.cache"]


def test_triton_setup_only_where_triton_will_run(monkeypatch):
    from deployments.startup import triton_setup
    assert triton_setup.start("cpu") is None
    monkeypatch.setenv("COLDSTART_TRITON", "0")
    assert triton_setup.start("cuda") is None and not triton_setup.wanted("cuda:1")
    monkeypatch.delenv("COLDSTART_TRITON")
    assert triton_setup.wanted("cuda:1") and triton_setup.wanted("auto") == os.path.exists("/dev/nvidiactl")


@gpu
def test_gpu_triton_setup_makes_tritons_driver(monkeypatch):
    """The driver object (its C helper module, the platform key) is made on the side
    thread, so the first self-test on the main thread finds it."""
    from triton.runtime.driver import driver

    from deployments.startup import triton_setup
    monkeypatch.setattr(driver, "_default", None)
    monkeypatch.setattr(driver, "_active", None)
    task = triton_setup.start("cuda").wait()
    assert task.error is None
    assert driver._active is not None and driver._default is driver._active
