"""deployments.kernels: the torch references against plain torch, the fallback and input checks,
and the Triton kernels under the Triton interpreter (on CPU); tests/test_kernels_device.py has
them on CUDA and the policy's tests and verdicts.

Triton reads TRITON_INTERPRET when it is first imported (its own library functions are
decorated then), so the interpreter cases cannot share a process with compiled kernels:
`test_triton_interpreter` reruns the `test_interp_*` cases of this file in a fresh
process with TRITON_INTERPRET=1 (or run `TRITON_INTERPRET=1 pytest tests/test_kernels.py`).
"""

from __future__ import annotations


import pytest
import torch

from deployments.kernels import ops
from helpers_kernels import (ATTN_CASES, DTYPES, EPS, INTERPRETED, NORM_SHAPES, PAGED_CASES, ROPE_CASES, SILU_SHAPES, TOL,
                             attn_inputs, rerun_interpreted,
                             gen, norm_inputs, paged_inputs, randn, rope_inputs)

# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_ref_add_rms_norm(shape, dtype):
    x, r, w = norm_inputs(shape, dtype, pad=3)
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
    gate_up = randn(*shape[:-1], 2 * n + 5, dtype=dtype, g=gen())[..., : 2 * n]  # strided rows
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
    qkv, cos, sin_f, kc, vc, pos, sin = rope_inputs(B, H, Hkv, Dh, pad, dtype)
    expect_q, expect_k, expect_v = _hf_rope_longhand(qkv, cos, sin, kc, vc, pos, H, Hkv, Dh)
    q = ops._ref_rope_store_kv(qkv, cos, sin_f, kc, vc, pos, H, Hkv, Dh)
    assert q.shape == (B, H, Dh) and q.is_contiguous() and q.dtype == dtype
    torch.testing.assert_close(q, expect_q, **TOL[dtype])
    torch.testing.assert_close(kc, expect_k, **TOL[dtype])
    assert torch.equal(vc, expect_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PAGED_CASES)
def test_ref_rope_store_kv_paged_writes_the_addressed_slot_only(case, dtype):
    """Row b's roped k and its v land at [block_table[b, p // bs], :, p % bs], as the static
    cache gets them at [b, :, p], and nothing else in the caches changes. The padding row's
    entry there is the null block: it writes the null block, never a block another row owns."""
    B, H, Hkv, Dh, bs, kv_len, _ = case
    qkv, cos, sin, *_ = rope_inputs(B, H, Hkv, Dh, 8, dtype)
    _, kp, vp, table, ks, vs, pos = paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype)
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
    qkv, cos, sin, *_ = rope_inputs(B, H, Hkv, Dh, 0, torch.float32)
    _, kp, vp, table, *_ = paged_inputs(B, H, Hkv, Dh, 16, 40, torch.float32)
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
    q, kp, vp, table, ks, vs, pos = paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, null_padding=null_padding)
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
    x, r, w = norm_inputs((3, 4100), dtype)
    normed, summed = ops.add_rms_norm(x, r, w, EPS)
    ref_normed, ref_summed = ops._ref_add_rms_norm(x, r, w, EPS)
    assert torch.equal(normed, ref_normed) and torch.equal(summed, ref_summed)

    gate_up = randn(3, 2 * 4100, dtype=dtype, g=gen(1))
    assert torch.equal(ops.silu_mul(gate_up), ops._ref_silu_mul(gate_up))

    qkv, cos, sin, kc, vc, pos, _ = rope_inputs(3, 8, 2, 128, 16, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    q = ops.rope_store_kv(qkv, cos, sin, kc, vc, pos, 8, 2, 128)
    assert torch.equal(q, ops._ref_rope_store_kv(qkv, cos, sin, kc2, vc2, pos, 8, 2, 128))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)

    q, kp, vp, table, _, _, pos = paged_inputs(3, 8, 2, 32, 16, 40, dtype)
    kp2, vp2 = kp.clone(), vp.clone()
    qkv, cos, sin, *_ = rope_inputs(3, 8, 2, 32, 0, dtype)
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
    proc, summary = rerun_interpreted(__file__, timeout=600)
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
    x, r, w = norm_inputs(shape, dtype, pad=5)
    normed, summed = interp._launch_add_rms_norm(x, r, w, EPS)
    ref_normed, ref_summed = interp._ref_add_rms_norm(x, r, w, EPS)
    assert normed.shape == summed.shape == x.shape and normed.is_contiguous() and summed.is_contiguous()
    _assert_rounded_like_torch(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_interp_silu_mul(interp, shape, dtype):
    n = shape[-1] // 2
    gate_up = randn(*shape[:-1], 2 * n + 7, dtype=dtype, g=gen(2))[..., : 2 * n]
    out = interp._launch_silu_mul(gate_up)
    assert out.shape == (*shape[:-1], n) and out.dtype == dtype
    torch.testing.assert_close(out, interp._ref_silu_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_interp_rope_store_kv(interp, case, dtype):
    B, H, Hkv, Dh, pad = case
    qkv, cos, sin, kc, vc, pos, _ = rope_inputs(B, H, Hkv, Dh, pad, dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    q = interp._launch_rope_store_kv(qkv, cos, sin, kc, vc, pos, H, Hkv, Dh)
    ref_q = interp._ref_rope_store_kv(qkv, cos, sin, ref_kc, ref_vc, pos, H, Hkv, Dh)
    assert q.shape == (B, H, Dh) and q.is_contiguous()
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(kc, ref_kc, **TOL[dtype])  # written rows close, the rest untouched
    assert torch.equal(vc, ref_vc)


def test_interp_rope_skips_out_of_range_position(interp):
    qkv, cos, sin, kc, vc, _, _ = rope_inputs(2, 4, 2, 64, 0, torch.float32, T=8)
    before_k, before_v = kc.clone(), vc.clone()
    interp._launch_rope_store_kv(qkv, cos, sin, kc, vc, torch.tensor([3, 8]), 4, 2, 64)
    assert torch.equal(kc[1:], before_k[1:]) and torch.equal(vc[1:], before_v[1:])  # row 1: position 8 >= T
    assert not torch.equal(kc[0, :, 3], before_k[0, :, 3]) and torch.equal(vc[0, :, 3], qkv[0, 384:].view(2, 64))


# (B, n_heads, n_kv, head_dim, T, kv_len, window): MHA, GQA, a kv_len that is not a whole
# number of key blocks, a sliding window, a padding row (position >= kv_len)
# Triton's interpreter computes a bf16 tl.dot wrongly (a 16x16 product is off by ~1e10),
# so the attention (tensor-core dots) runs in bf16 only on the GPU
# (test_gpu_decode_attention_matches_reference).
@pytest.mark.parametrize("case, dtype", [(c, d) for c in ATTN_CASES for d in DTYPES if d != torch.bfloat16])
def test_interp_decode_attention(interp, case, dtype):
    B, H, Hkv, Dh, T, kv_len, window = case
    q, kc, vc, pos = attn_inputs(B, H, Hkv, Dh, T, kv_len, dtype)
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
    q, kc, vc, _ = attn_inputs(B, H, Hkv, Dh, T, T, torch.float32)
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
    q, kc, vc, pos = attn_inputs(B, H, Hkv, Dh, T, kv_len, torch.float32)
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
    qkv, cos, sin, *_ = rope_inputs(B, H, Hkv, Dh, 8, dtype)
    _, kp, vp, table, _, _, pos = paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype)
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
    qkv, cos, sin, *_ = rope_inputs(B, H, Hkv, Dh, 0, torch.float32)
    _, kp, vp, table, *_ = paged_inputs(B, H, Hkv, Dh, bs, 40, torch.float32)
    assert table.shape[1] * bs == 64
    want_k, want_v = kp.clone(), vp.clone()
    interp._launch_rope_store_kv(qkv, cos, sin, kp, vp, torch.tensor([5, 64, -1]), H, Hkv, Dh, table)
    blk = int(table[0, 0])
    assert not torch.equal(kp[blk, :, 5], want_k[blk, :, 5])
    want_k[blk, :, 5] = kp[blk, :, 5]
    want_v[blk, :, 5] = qkv[0, (H + Hkv) * Dh :].view(Hkv, Dh)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)


# bf16 left out as in test_interp_decode_attention (the interpreter's bf16 tl.dot)
@pytest.mark.parametrize("block_n", [None, 16, 32])
@pytest.mark.parametrize("null_padding", [False, True])
@pytest.mark.parametrize("case, dtype", [(c, d) for c in PAGED_CASES for d in DTYPES if d != torch.bfloat16])
def test_interp_decode_attention_paged(interp, case, dtype, null_padding, block_n):
    """As the paged reference; and, with the same key blocks (one may span several cache blocks),
    the very result of the static kernel over the same logical keys."""
    B, H, Hkv, Dh, bs, kv_len, window = case
    q, kp, vp, table, ks, vs, pos = paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, null_padding=null_padding)
    out = interp._launch_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, block_n, block_table=table)
    ref = interp._ref_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, table)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **({} if dtype == torch.float32 else TOL[dtype]))
    assert torch.equal(out, interp._launch_decode_attention(q, ks, vs, pos, kv_len, window, Dh**-0.5, block_n))


@pytest.mark.parametrize("case", PAGED_CASES + [(4, 4, 2, 32, 16, 256, 0)])
def test_interp_decode_attention_paged_reads_no_key_past_the_position(interp, case):
    """Only the blocks of a row's keys up to its position (up to kv_len for the padding row)
    are read: NaN in the rest of each row's last block and in every block no row reads (another
    sequence's, unowned ones) changes nothing. The last case's kv_len is the whole table
    (max_blocks * block_size), its rows short ones in that bound."""
    B, H, Hkv, Dh, bs, kv_len, window = case
    max_blocks = kv_len // bs if kv_len == 256 else None
    q, kp, vp, table, *_, pos = paged_inputs(B, H, Hkv, Dh, bs, kv_len, torch.float32, max_blocks=max_blocks)
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
    g = gen(3)
    x, w = randn(1, K, dtype=dtype, g=g), randn(N, K + 8, dtype=dtype, g=g)[:, :K]  # strided rows
    b = randn(N, dtype=dtype, g=g) if has_bias else None
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
    from deployments.model import build_model
    from helpers_engine import engine_greedy_matches_transformers, hf_model
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
    engine_greedy_matches_transformers(model, hf)


@pytest.mark.parametrize("heads, block_size, blocks_per_seq", [((4, 2), 16, 32), ((4, 4), 32, 5)])
def test_interp_paged_self_test_cases_pass_and_catch_a_wrong_kernel(interp, heads, block_size, blocks_per_seq):
    """The paged self-test's cases (kernels.policy.paged_cases), run with the interpreted kernels:
    they agree with the references, and a kernel that reads the wrong block is caught."""
    from deployments.kernels import policy

    H, Hkv = heads

    def attention(*a):
        return interp._launch_decode_attention(*a[:7], block_table=a[7])

    def misread(*a):  # the table's rows swapped: each row reads the other's blocks
        return interp._launch_decode_attention(*a[:7], block_table=a[7].flip(0).contiguous())

    def cases(att):
        return policy.paged_cases(H, Hkv, 32, block_size, blocks_per_seq, torch.float32, "cpu",
                                  lambda key, fn, *a: fn(*a), rope=interp._launch_rope_store_kv, attention=att)
    assert policy._compare(lambda: cases(attention)("rope_store_kv"), torch.float32) is None
    assert policy._compare(lambda: cases(attention)("decode_attention"), torch.float32) is None
    why = policy._compare(lambda: cases(misread)("decode_attention"), torch.float32)
    assert why is not None and why.startswith("decode_attention (paged, window 0) differs from the torch reference")
