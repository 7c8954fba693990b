"""deployments.kernels.quant: the weight-only Triton kernel under the Triton interpreter (on the
CPU) against its torch reference, for each scheme, odd shapes and the last partial group; the
plan's fallback where no kernel runs; and the fp8 _scaled_mm path's activation quantisation.
(Same interpreter arrangement as tests/test_kernels.py: `test_triton_interpreter` reruns the
`test_interp_*` cases in a fresh TRITON_INTERPRET=1 process.)"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from deployments.kernels import quant as qk
from deployments.model.quant import QuantLinear, method_for
from conftest import gpu
from helpers_kernels import INTERPRETED, TOL, rerun_interpreted
from helpers_quant import SCHEMES, quantize_layer
from weights.quant import scheme_of



def _spec(scheme: str, N: int, K: int, seed: int = 0) -> qk.WeightSpec:
    gen = torch.Generator().manual_seed(seed)
    stored, _ = quantize_layer(torch.randn(N, K, generator=gen), scheme, gen)
    method = method_for(scheme_of({"quantization_config": SCHEMES[scheme]}))
    layer = QuantLinear(method, K, N, False, tuple(t for t in method.optional if t not in stored))
    for k, v in stored.items():
        setattr(layer, k, torch.nn.Parameter(v, requires_grad=False))
    return method.spec(layer)


def test_without_a_gpu_every_kernel_is_off_and_the_reference_runs():
    spec = _spec("awq", 16, 64)
    assert qk.choose({"x": spec}, torch.float32, torch.device("cpu")) == qk.QuantKernels()
    x = torch.randn(2, 64)
    assert torch.equal(qk.wo_matmul(x, spec), x @ qk.dequantize(spec, torch.float32).t())


def test_wo_matmul_refuses_a_row_of_the_wrong_width():
    with pytest.raises(ValueError, match="x has 63 columns, the layer takes 64"):
        qk.wo_matmul(torch.randn(1, 63), _spec("gptq", 16, 64))


def test_rowwise_fp8_quantisation_keeps_each_row_within_its_scale():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 300.0, 1e4])[:, None]
    xq, s = qk._quantize_rows(x)
    back = xq.float() * s
    assert xq.dtype == torch.float8_e4m3fn and s.shape == (5, 1)
    assert ((back - x).abs().amax(1) <= x.abs().amax(1) * 2**-3).all()  # e4m3: 3 mantissa bits


# ----------------------------------------------------------------------------- Triton interpreter

def test_triton_interpreter():
    """Reruns this file's test_interp_* cases in a fresh process with TRITON_INTERPRET=1."""
    proc, summary = rerun_interpreted(__file__, timeout=900)
    assert proc.returncode == 0 and "failed" not in summary, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.fixture
def interp():
    pytest.importorskip("triton")
    if not INTERPRETED:
        pytest.skip("runs in a TRITON_INTERPRET=1 process (test_triton_interpreter)")
    return qk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor", "fp8-block", "awq", "gptq", "gptq-act-order", "gptq-v2"])
# 72, 40, 160: a partial last group; 160 (int4) and 512: K cut into two parts (kernels.quant._split_k)
@pytest.mark.parametrize("N,K,M", [(40, 72, 1), (8, 40, 3), (64, 160, 17), (16, 512, 3)])
def test_interp_wo_matmul(interp, scheme, N, K, M, dtype):
    if dtype == torch.bfloat16:
        # the interpreter's tl.dot of two bf16 tiles returns garbage (Triton 3.9; the same 16 x 16 product
        # in fp16 is exact): bf16 is judged on the GPU by kernels.quant.choose's self-test
        pytest.skip("tl.dot on bf16 is wrong under TRITON_INTERPRET")
    spec = _spec(scheme, N, K)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K + 3, generator=g).to(dtype)[:, :K]  # strided rows
    bias = torch.randn(N, generator=g).to(dtype) if M == 3 else None
    got = interp._launch_wo_matmul(x, spec, bias)
    want = interp._ref_wo_matmul(x.float(), spec, None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (M, N)
    # fp32: the same products summed in another order; fp16/bf16: the weight rounded to the dtype as
    # the reference rounds it, then one rounding of an fp32 sum
    ref = interp._ref_wo_matmul(x, spec, bias).float() if dtype != torch.float32 else want
    torch.testing.assert_close(got.float(), ref, **{k: v * 4 for k, v in TOL[dtype].items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor", "fp8-block", "awq", "gptq", "gptq-act-order", "gptq-v2"])
# 72, 40: a partial last group (and step); 1024 and 512: K cut into parts, the last of each
# tile's programs adding them (kernels.quant_jit._store_out)
@pytest.mark.parametrize("N,K", [(40, 72), (8, 40), (64, 1024), (16, 512)])
def test_interp_one_row_takes_the_gemv(interp, scheme, N, K, dtype, monkeypatch):
    from deployments.kernels import ops
    monkeypatch.setattr(ops, "available", lambda device: True)
    spec = _spec(scheme, N, K)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1, K + 3, generator=g).to(dtype)[..., :K]  # a strided row, leading dims kept
    bias = torch.randn(N, generator=g).to(dtype) if K == 40 else None
    got = interp.wo_matmul(x, spec, bias)
    assert torch.equal(got, interp._launch_wo_gemv(x, spec, bias))  # (wo_matmul's path for one row)
    want = interp._ref_wo_matmul(x.float(), spec, None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (1, 1, N)
    # the dequantized weight in fp32 times the row (the tile rounds the weight to the row's dtype first)
    torch.testing.assert_close(got.float(), want, **{k: v * 4 for k, v in TOL[dtype].items()})
    assert not interp._COUNTERS["cpu"].any()  # every split tile's count set back to 0


def test_interp_a_split_gemv_adds_its_parts_in_one_order(interp):
    """The split launch's parts are added by whichever program ends last, always part 0 first:
    the same bits as the parts added in order by hand, and at every call."""
    spec = _spec("awq", 64, 1024)
    blocks = interp.GemvBlocks(64, 32, 4, 8)
    x = torch.randn(1, 1024)
    split = interp._split_k(1, 1024 // 32, torch.device("cpu"), blocks.per_sm, least=1)
    assert split == 16
    got = interp._launch_wo_gemv(x, spec, None, blocks)
    w = interp.dequantize(spec, torch.float32)
    parts = [x[:, p * 64:(p + 1) * 64] @ w[:, p * 64:(p + 1) * 64].t() for p in range(split)]
    torch.testing.assert_close(got, sum(parts[1:], parts[0]), rtol=1e-5, atol=1e-5)
    assert torch.equal(got, interp._launch_wo_gemv(x, spec, None, blocks))


def test_gemv_blocks_follow_the_layout_and_refuse_a_step_across_groups():
    assert qk._gemv_blocks(_spec("awq", 64, 160)) == (64, 32, 4, 4)  # groups of 32
    assert qk._gemv_blocks(_spec("gptq-act-order", 64, 160))[:2] == (128, 64)
    assert qk._gemv_blocks(_spec("ct-channel", 64, 4096))[:2] == (2, 1024)
    assert qk._gemv_blocks(_spec("ct-channel", 64, 72))[:2] == (2, 128)
    with pytest.raises(ValueError, match="must lie in one group of 32 rows"):
        qk._launch_wo_gemv(torch.randn(1, 160), _spec("awq", 64, 160), None, qk.GemvBlocks(64, 64))


@pytest.mark.parametrize("K", [300, 4096, 5000])
def test_interp_rows_quantized_in_one_pass_equal_torchs(interp, K, monkeypatch):
    from deployments.kernels import ops
    x = (torch.randn(7, K) * torch.logspace(-4, 4, 7)[:, None]).to(torch.float16)
    got_q, got_s = interp._quantize_rows(x, 16)
    monkeypatch.setattr(ops, "available", lambda device: False)
    want_q, want_s = interp._quantize_rows(x, 16)
    assert got_q.shape == (16, K) and torch.equal(got_s, want_s) and (got_s[7:] == 1).all()
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and not got_q[7:].float().any()


def test_the_weight_only_kernel_cuts_k_for_few_programs_and_reads_a_groups_scales_once():
    spec = _spec("awq", 64, 160)  # groups of 32
    assert qk._wo_blocks(spec)[:4] == (16, 64, 32, True)
    assert qk._wo_blocks(_spec("gptq-act-order", 64, 160)).tile is False  # (g_idx: each row its own group)
    assert qk._wo_blocks(_spec("ct-channel", 64, 160))[:4] == (16, 32, 128, False)
    assert qk._split_k(128, 32, torch.device("cpu")) == 1  # (the interpreter's two "multiprocessors")
    assert qk._split_k(2, 5, torch.device("cpu")) == 2  # each part at least two tiles
    assert qk._split_k(1, 64, torch.device("cpu")) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor", "fp8-block", "awq", "gptq", "gptq-act-order", "gptq-v2"])
@pytest.mark.parametrize("N,K", [(40, 72), (64, 160), (16, 512)])
def test_interp_dequantize_kernel_equals_the_reference_bit_for_bit(interp, scheme, N, K, dtype):
    spec = _spec(scheme, N, K)
    got = interp.dequantize_kernel(spec, dtype)
    assert got.dtype == dtype and torch.equal(got, interp.dequantize(spec, dtype))


def test_interp_a_wide_batch_multiplies_the_kernels_dequantized_weight(interp):
    """Rows beyond the weight-only kernel's (a prefill): the layer's weight made by the Triton
    dequantize, then one matmul, where the kernels passed their test."""
    from deployments.model.quant import base
    spec = _spec("awq", 64, 160)
    method = base.QuantMethod.__new__(base.QuantMethod)
    method.kernels = interp.QuantKernels(weight_only=True)
    method.spec = lambda layer: spec
    method.dequantize = lambda layer, dtype: pytest.fail("the torch reference ran")
    x = torch.randn(interp.WO_MAX_ROWS + 16, 160)
    torch.testing.assert_close(method.apply(None, x, None), x @ interp.dequantize(spec, torch.float32).t())
    assert interp.QuantKernels(weight_only=True).describe() == "Triton weight-only (else Triton dequantize + matmul)"


def test_a_step_past_sixteen_rows_takes_fp8_tensor_cores_where_they_passed(monkeypatch):
    """Rows 1..WO_SMALL_ROWS: the weight-only kernel; more: _scaled_mm where its test passed, else
    the weight-only kernel (64-row tiles) up to WO_MAX_ROWS; beyond: dequantize, then matmul."""
    from deployments.model.quant import base
    spec = _spec("ct-channel", 16, 64)
    took: list[str] = []
    monkeypatch.setattr(qk, "wo_matmul", lambda x, s, b: took.append("wo") or x @ qk.dequantize(s, x.dtype).t())
    monkeypatch.setattr(qk, "fp8_scaled_mm", lambda x, s, b: took.append("mm") or x @ qk.dequantize(s, x.dtype).t())
    monkeypatch.setattr(qk, "dequantize_kernel", lambda s, d: took.append("dq") or qk.dequantize(s, d))
    method = base.QuantMethod.__new__(base.QuantMethod)
    method.spec = lambda layer: spec
    for kernels, rows, want in ((qk.QuantKernels(True, True), (1, 16, 17, 200), ["wo", "wo", "mm", "mm"]),
                                (qk.QuantKernels(True, False), (16, 17, 128, 129), ["wo", "wo", "wo", "dq"])):
        took.clear()
        method.kernels = kernels
        for m in rows:
            method.apply(None, torch.randn(m, 64), None)
        assert took == want
    assert qk._wo_blocks(spec, 16).m == 16 and qk._wo_blocks(spec, 17).m == 64


def test_interp_wo_matmul_keeps_leading_dims(interp):
    spec = _spec("awq", 16, 64)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(interp._launch_wo_matmul(x, spec, None), interp._ref_wo_matmul(x, spec, None),
                               rtol=1e-5, atol=1e-5)


FUSED = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # fp8 q/k/v each a multiple of 4 KiB


@pytest.mark.parametrize("arch,scheme,kw", [("llama", "ct-channel", {}), ("qwen2", "gptq-act-order", {}),
                                            ("mistral", "ct-tensor", FUSED)])
def test_interp_engine_on_a_quantized_pack_gives_transformers_greedy_tokens(interp, monkeypatch, tmp_path, arch,
                                                                             scheme, kw):
    """The GPU's path, interpreted: the plan chosen by kernels.quant.choose (its self-test passes on
    synthetic layers of the model's shapes), the weight-only kernel in every decode step, the fused
    norms beside it; where fp8 q/k/v fuse, the fused decode too (rope + KV write, the attention kernel)."""
    from deployments.kernels import ops
    from deployments.kernels.policy import KernelPlan
    from deployments.model import build_model
    from deployments.model.quant import kernel_specs
    from helpers_engine import engine_greedy_matches_transformers, hf_model
    from helpers_quant import quantized_checkpoint
    from weights import PackOptions, load, pack

    monkeypatch.setattr(ops, "available", lambda device: True)
    hf, cfg = hf_model(arch, **kw)
    m = load(pack(quantized_checkpoint(hf, cfg, scheme, tmp_path / "hf"), tmp_path / "packed",
                  PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    method = model.model.layers[0].mlp.down_proj.method
    assert method.kernels.weight_only and not method.kernels.scaled_mm  # (choose ran the interpreted self-test)
    fused = isinstance(model.model.layers[0].self_attn.qkv_w, torch.nn.Module)
    assert fused == bool(kw)
    # q/o, k/v, gate/up, down: one layer of each shape tested (and the fused qkv and gate_up)
    assert len(kernel_specs(model)) == 4 + 2 * fused
    model.kernels = KernelPlan(fused=True, attention=fused)
    assert model.attention_kernel() == fused
    engine_greedy_matches_transformers(model, hf, timeout=300)


# ----------------------------------------------------------------------------- CUDA

def _cuda_spec(scheme: str, N: int, K: int) -> qk.WeightSpec:
    spec = _spec(scheme, N, K)
    for f in ("q", "s", "z", "g_idx"):
        if getattr(spec, f) is not None:
            setattr(spec, f, getattr(spec, f).cuda())
    return spec


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor", "fp8-block", "awq", "gptq", "gptq-act-order"])
@pytest.mark.parametrize("M", [1, 7, 64])
def test_gpu_wo_matmul_matches_the_reference_and_replays_in_a_graph(scheme, M, dtype):
    from deployments.kernels import ops
    if INTERPRETED or not ops.available("cuda"):
        pytest.skip("compiled Triton kernels are not available in this process")
    spec = _cuda_spec(scheme, 4096 if scheme != "fp8-block" else 4096, 4096)
    x = torch.randn(M, 4096, device="cuda").to(dtype)
    want = qk._ref_wo_matmul(x.float(), spec, None)
    got = qk.wo_matmul(x, spec)
    assert qk._relative_error(got, want) < 2e-2
    from deployments.kernels.policy import capture_graph
    graph = capture_graph(lambda: qk.wo_matmul(x, spec), "cuda")
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("order", [tuple(range(8)), (0, 2, 4, 6, 1, 3, 5, 7)], ids=["gptq", "awq"])
def test_unpack_int4_reads_no_host_index(order):
    """The dequantize path runs inside a decode step's CUDA graph where a step has more rows than
    the weight-only kernel takes. An index built from a Python list is copied from the host at
    each call, which the capture refuses: the unpacking must select its nibbles by shifts alone
    (on the meta device, the ops it dispatches; the values: ``test_quant``'s round trip)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    words = torch.empty(6, 5, dtype=torch.int32, device="meta")
    with Ops():
        out = qk.unpack_int4(words, 1, order)
    assert out.shape == (6, 40) and ops, ops
    assert not [o for o in ops if o.startswith(("aten.index", "aten._to_copy", "aten.lift"))], ops


@gpu
@pytest.mark.parametrize("scheme", ["ct-channel", "fp8-block", "awq", "gptq-act-order"])
def test_gpu_dequantize_matmul_replays_in_a_graph(scheme):
    """A decode step of 128 rows runs the dequantize path inside its CUDA graph."""
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1")
    spec = _cuda_spec(scheme, 4096, 4096)
    x = torch.randn(128, 4096, device="cuda", dtype=torch.float16)
    want = qk._ref_wo_matmul(x, spec, None)
    from deployments.kernels.policy import capture_graph
    out: list[torch.Tensor] = []
    graph = capture_graph(lambda: out.append(qk._ref_wo_matmul(x, spec, None)), "cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[-1], want)
    fast: list[torch.Tensor] = []  # the one-pass Triton dequantize, as a wide step runs it
    graph = capture_graph(lambda: fast.append(F.linear(x, qk.dequantize_kernel(spec, x.dtype))), "cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(fast[-1], want)


@gpu
def test_gpu_choose_keeps_the_kernels_that_pass_on_the_models_layers():
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1")
    specs = {"q": _cuda_spec("ct-channel", 4096, 4096), "down": _cuda_spec("ct-channel", 4096, 11008)}
    plan = qk.choose(specs, torch.bfloat16, torch.device("cuda"))
    assert plan.weight_only
    if torch.cuda.get_device_capability() >= (8, 9):
        assert plan.scaled_mm
        x = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16)
        assert qk._relative_error(qk.fp8_scaled_mm(x, specs["q"]), qk._ref_wo_matmul(x, specs["q"], None)) < 6e-2


@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor", "fp8-block", "awq", "gptq-act-order"])
def test_the_self_tests_run_on_a_synthetic_layer_of_the_same_kind(scheme):
    """A model built over a buffer still loading has no weights yet (unloaded fp8 bytes may be NaNs)."""
    spec = _spec(scheme, 40, 72)
    if spec.q.dtype.itemsize == 1:  # fp8 NaNs where the weights will be
        spec.q = torch.full_like(spec.q.view(torch.uint8), 0x7F).view(spec.q.dtype)
    fake = qk.synthetic(spec)
    assert (fake.scheme, fake.n, fake.k, fake.group) == (spec.scheme, spec.n, spec.k, spec.group)
    assert fake.block == spec.block
    for a, b in ((fake.q, spec.q), (fake.s, spec.s), (fake.z, spec.z), (fake.g_idx, spec.g_idx)):
        assert (a is None) == (b is None) and (a is None or (a.shape, a.dtype) == (b.shape, b.dtype))
    w = qk.dequantize(fake, torch.float32)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    if fake.g_idx is not None:
        assert 0 <= int(fake.g_idx.min()) and int(fake.g_idx.max()) < -(-spec.k // spec.group)
