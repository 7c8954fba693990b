"""deployments.kernels on CUDA (against the references, inside a CUDA graph), the batch-1 GEMV, the
decode attention's reference against the model's, and the policy's self-tests and kept verdicts
(the CUDA cases run on a GPU; tests/test_kernels.py has the references and the interpreter)."""

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
from helpers_kernels import ATTN_CASES, EPS, PAGED_CASES, TOL, attn_inputs, gen, norm_inputs, paged_inputs, randn, rope_inputs

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
    x, r, w = norm_inputs((B, 4096), dtype, device="cuda", pad=64)
    normed, summed = ops.add_rms_norm(x, r, w, EPS)
    ref_normed, ref_summed = ops._ref_add_rms_norm(x, r, w, EPS)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])

    gate_up = randn(B, 2 * 14336 + 64, dtype=dtype, g=gen(3), device="cuda")[:, : 2 * 14336]
    torch.testing.assert_close(ops.silu_mul(gate_up), ops._ref_silu_mul(gate_up), **TOL[dtype])

    qkv, cos, sin, kc, vc, pos, _ = rope_inputs(B, 32, 8, 128, 64, dtype, device="cuda", T=128, slots=80)
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
    x, r, w = norm_inputs((B, D), dtype, device="cuda")
    gate_up = randn(B, 2 * n, dtype=dtype, g=gen(4), device="cuda")
    qkv, cos, sin, kc, vc, pos, _ = rope_inputs(B, H, Hkv, Dh, 0, dtype, device="cuda", T=T)

    def step():
        return ops.add_rms_norm(x, r, w, EPS), ops.silu_mul(gate_up), \
            ops.rope_store_kv(qkv, cos, sin, kc, vc, pos, H, Hkv, Dh)

    graph, ((normed, summed), act, q) = _captured(step)

    for seed in (10, 11):  # new inputs and positions each replay
        x2, r2, _ = norm_inputs((B, D), dtype, device="cuda", seed=seed)
        x.copy_(x2), r.copy_(r2)
        gate_up.copy_(randn(B, 2 * n, dtype=dtype, g=gen(seed), device="cuda"))
        new = rope_inputs(B, H, Hkv, Dh, 0, dtype, device="cuda", T=T, seed=seed)
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
    g = gen(5)
    x, w, b = randn(1, 1, 24, dtype=torch.float32, g=g), randn(7, 24, dtype=torch.float32, g=g), \
        randn(7, dtype=torch.float32, g=g)
    assert torch.equal(ops.gemv(x, w, b), torch.nn.functional.linear(x, w, b))
    chosen, report = policy.gemv_choice({"proj": [(w, b)]})
    assert chosen == set() and "not available" in report["proj"]["error"]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N, K", [(4096, 4096), (12288, 4096), (4096, 11008), (32000, 4096), (1000, 300)])
def test_gpu_gemv_matches_linear_and_is_timed(monkeypatch, N, K, dtype):
    _use_triton(monkeypatch)
    g = gen(6)
    x, w = randn(1, K, dtype=dtype, g=g, device="cuda"), randn(N, K, dtype=dtype, g=g, device="cuda")
    b = randn(N, dtype=dtype, g=g, device="cuda")
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
    q, kc, vc, pos = attn_inputs(B, H, Hkv, Dh, T, L, torch.float32)
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
    q, kc, vc, pos = attn_inputs(B, H, Hkv, Dh, T, kv_len, dtype, device="cuda")
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
    q, kp, vp, table, ks, vs, pos = paged_inputs(B, H, Hkv, Dh, bs, kv_len, dtype, device="cuda")
    out = ops.decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, block_table=table)
    torch.testing.assert_close(out, ops._ref_decode_attention(q, kp, vp, pos, kv_len, window, Dh**-0.5, table),
                               **TOL[dtype])
    torch.testing.assert_close(out, ops.decode_attention(q, ks, vs, pos, kv_len, window, Dh**-0.5), **TOL[dtype])
    qkv, cos, sin, *_ = rope_inputs(B, H, Hkv, Dh, 8, dtype, device="cuda")
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
    kp, vp = (randn(num_blocks, Hkv, bs, Dh, dtype=dtype, g=gen(i), device="cuda") for i in range(2))
    table = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    q = torch.zeros(B, H, Dh, dtype=dtype, device="cuda")
    qkv, cos, sin, *_ = rope_inputs(B, H, Hkv, Dh, 0, dtype, device="cuda")

    def step():
        q_out = ops.rope_store_kv(qkv, cos, sin, kp, vp, pos, H, Hkv, Dh, block_table=table)
        return q_out, ops.decode_attention(q, kp, vp, pos, kv_len, 0, Dh**-0.5, block_table=table)

    graph, (q_out, out) = _captured(step)

    for seed in (20, 21):  # every row's blocks distinct (a shuffle of 1..num_blocks-1), the last row padding
        g = gen(seed)
        table.copy_((1 + torch.randperm(num_blocks - 1, generator=g)).view(B, max_blocks))
        new_pos = torch.randint(0, kv_len, (B,), generator=g)
        new_pos[-1] = max_blocks * bs - 1
        pos.copy_(new_pos)
        q.copy_(randn(B, H, Dh, dtype=dtype, g=g))
        qkv.copy_(randn(*qkv.shape, dtype=dtype, g=g))
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
    assert all("not available" in why for why in policy.paged_self_test(4, 2, 16, 16, 8, torch.float32, "cpu"))


@pytest.mark.parametrize("result, want", [(("rope_store_kv (paged) differs", None), (False, False)),
                                          ((None, "decode_attention (paged, window 0) differs"), (True, False)),
                                          ((None, None), (True, True))])
def test_a_failed_paged_self_test_turns_off_what_it_needs(monkeypatch, caplog, result, want):
    """The paged variants' verdicts decide the plan of a paged engine's model: a failed rope + KV
    write leaves torch's kernels, a failed attention the batched matmuls; each said in the log."""
    monkeypatch.setattr(policy, "paged_self_test", lambda *a, **k: result)
    plan = policy.KernelPlan(fused=True, attention=True, gemv=frozenset({(8, 8)}), seconds={"kernel_test": 1.0})
    with caplog.at_level("WARNING", logger="deployments.kernels.policy"):
        got = policy.paged_check((4, 2, 16), 16, 8, torch.float16, torch.device("cuda"), plan)
    assert (got.fused, got.attention) == want
    assert got.gemv == (plan.gemv if got.fused else frozenset())
    assert "kernel_test" in got.seconds and "paged_kernel_test" in got.seconds
    for why in result:
        assert why is None or why in caplog.text
    assert policy.paged_check((4, 2, 16), 16, 8, torch.float16, torch.device("cpu"), policy.KernelPlan()) \
        == policy.KernelPlan()  # no fused kernels: nothing to test


@gpu
def test_gpu_paged_self_tests_pass_and_are_kept(monkeypatch, tmp_path):
    _use_triton(monkeypatch)
    for first in (True, False):
        times: dict[str, float] = {}
        assert policy.paged_self_test(32, 32, 128, 16, 256, torch.float16, "cuda", times, keep=tmp_path) == (None, None)
        assert ("triton" in times) == first, times
    assert len(list(tmp_path.glob("coldstart-selftest-*.json"))) == 2
    times = {}
    assert policy.paged_self_test(32, 8, 128, 32, 6, torch.bfloat16, "cuda", times, keep=tmp_path) == (None, None)
    assert "triton" in times  # another geometry: another verdict


@gpu
def test_gpu_paged_engine_keeps_its_kernels(monkeypatch, tmp_path):
    """A paged engine's model passes the paged test at its cache's geometry and decodes through
    the Triton attention (one key-length bound: each row reads up to its own position)."""
    _use_triton(monkeypatch)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from deployments.engine import Engine, EngineConfig
    from deployments.model import build_model
    from helpers_engine import hf_model, state_tensors

    hf, cfg = hf_model("llama")
    model = build_model(cfg, {k: v.to("cuda", torch.float16) for k, v in state_tensors(hf).items()})
    assert model.kernels.fused and model.kernels.attention
    eng = Engine(model, None, EngineConfig(max_slots=4, max_seq_len=96, kv_cache="paged", kv_blocks=40))
    assert model.kernels.attention and eng.runner.kv_lens == eng.config.kv_len_buckets[-1:]
    assert eng.runner.stats["paged_kernel_test_s"] > 0


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
