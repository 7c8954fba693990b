"""Quantized checkpoints (``weights.quant``, ``deployments.model.quant``): each scheme's tensors
dequantize to the reference's values bit for bit (fp8: compressed-tensors' own decompression),
the packer keeps them as they are and records the scheme, ``pack --quantize fp8`` makes a
per-channel fp8 pack, and the native decoder over a quantized pack computes what transformers
computes with the weights dequantized (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import gpu
from deployments.model import build_model
from deployments.model.quant import method_for
from deployments.kernels.quant import unpack_int4
from helpers_engine import engine_greedy_matches_transformers, hf_model
from helpers_quant import SCHEMES, pack_nibbles, quantized_checkpoint
from weights import PackOptions, SourceError, load, pack, read_packed, verify
from weights.quant import AWQ_ORDER, scheme_of
from weights.quantize import pack_int4, quantize_fp8


def _ct_scheme(strategy: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", strategy=strategy))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("shape", [(48, 64), (7, 33), (1, 5)])
def test_fp8_dequantizes_as_compressed_tensors_decompresses(strategy, shape):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    q, s = quantize_fp8(w, strategy)
    ref = FloatQuantizationCompressor.decompress({"weight": q, "weight_scale": s}, _ct_scheme(strategy))["weight"]
    method = method_for(scheme_of({"quantization_config": SCHEMES[f"ct-{strategy}"]}))
    layer = _layer(method, {"weight": q, "weight_scale": s}, *shape)
    assert torch.equal(method.dequantize(layer, torch.float32), ref)
    # the quantiser is compressed-tensors' own: the same bytes from its compressor
    ct = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": s}, _ct_scheme(strategy))["weight"]
    assert torch.equal(ct.view(torch.uint8), q.view(torch.uint8))


def _layer(method, tensors: dict, N: int, K: int):
    from deployments.model.quant import QuantLinear
    layer = QuantLinear(method, K, N, False, tuple(t for t in method.optional if t not in tensors))
    for k, v in tensors.items():
        setattr(layer, k, torch.nn.Parameter(v, requires_grad=False))
    return layer


@pytest.mark.parametrize("scheme", ["fp8-block", "awq", "gptq", "gptq-act-order", "gptq-v2", "fbgemm"])
@pytest.mark.parametrize("shape", [(64, 96), (40, 72), (8, 40)])  # 72, 40: the last group (or block) partial
def test_each_scheme_dequantizes_to_the_references_values(scheme, shape):
    from helpers_quant import quantize_layer
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen)
    stored, want = quantize_layer(w, scheme, gen)
    method = method_for(scheme_of({"quantization_config": SCHEMES[scheme]}))
    layer = _layer(method, stored, *shape)
    assert torch.equal(method.dequantize(layer, torch.float32), want)
    x = torch.randn(3, shape[1], generator=gen)
    torch.testing.assert_close(layer(x), x @ want.t(), rtol=1e-5, atol=1e-5)


def test_int4_packing_matches_the_nibble_by_nibble_reference():
    x = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    assert torch.equal(pack_int4(x, 0), pack_nibbles(x, along_rows=True))
    assert torch.equal(pack_int4(x, 1, AWQ_ORDER), pack_nibbles(x, along_rows=False, order=AWQ_ORDER))
    assert torch.equal(unpack_int4(pack_int4(x, 1, AWQ_ORDER), 1, AWQ_ORDER), x)
    assert torch.equal(unpack_int4(pack_int4(x, 0), 0), x)


CASES = {"llama": dict(attention_bias=True), "mistral": dict(sliding_window=7), "qwen2": {}}


def _packed_model(arch: str, scheme: str, tmp_path, **kw):
    hf, cfg = hf_model(arch, **{**CASES[arch], **kw})
    src = quantized_checkpoint(hf, cfg, scheme, tmp_path / "hf")
    dest = pack(src, tmp_path / "packed", PackOptions(progress=False))
    m = load(dest, "cpu")
    return hf, m, build_model(m.config, m.tensors)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", list(CASES))
def test_native_logits_on_a_quantized_pack_match_transformers_dequantized(arch, scheme, tmp_path):
    """Tolerance: 1e-4 absolute on logits of order 10 (fp32 both sides; the native path
    multiplies by the dequantized weight, transformers by the same values stored in fp32)."""
    hf, m, model = _packed_model(arch, scheme, tmp_path)
    assert m.packed.index.metadata["quantization"] == scheme_of({"quantization_config": SCHEMES[scheme]}).to_json()
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.method.dequant_bytes in (8, 16)
    # the engine's reserve covers the dequantize path's copy of the widest layer (gate/up: 96 x 64)
    assert model.transient_weight_bytes == 96 * 64 * (layer.method.dequant_bytes + 4)
    marker = layer.method.marker
    # parameters are views of the one loaded buffer: nothing dequantized ahead
    assert getattr(layer, marker).untyped_storage().data_ptr() == m.buffer.untyped_storage().data_ptr()
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


def _engine_greedy(model, hf, cache: str, steps: int = 32) -> None:
    kw = dict(kv_block_size=16) if cache == "paged" else {}
    engine_greedy_matches_transformers(model, hf, steps=steps, prefill_chunk=8, kv_cache=cache, **kw)


@pytest.mark.parametrize("cache", ["static", "paged"])
@pytest.mark.parametrize("arch,scheme", [("llama", "ct-channel"), ("mistral", "awq"), ("qwen2", "gptq-act-order"),
                                         ("llama", "ct-tensor"), ("mistral", "fp8-block"), ("qwen2", "fbgemm"),
                                         ("llama", "gptq"), ("mistral", "gptq-v2")])
def test_engine_greedy_tokens_equal_transformers_for_32_steps(arch, scheme, cache, tmp_path):
    hf, _, model = _packed_model(arch, scheme, tmp_path)
    _engine_greedy(model, hf, cache)


@pytest.mark.parametrize("arch,scheme", [("mistral", "awq"), ("qwen2", "gptq-act-order"), ("llama", "gptq")])
def test_int4_layers_that_cannot_fuse_still_take_the_fused_decode_path(arch, scheme, tmp_path):
    """An int4 scheme's q/k/v and gate/up are not one view (their words pack an input row's
    outputs together), yet the decode step runs the fused path (rope + KV write, the decode
    attention through the paged table: here the kernels' torch references on the CPU) over their
    products joined, and computes what transformers does."""
    from deployments.kernels.policy import KernelPlan
    hf, _, model = _packed_model(arch, scheme, tmp_path)
    assert all(la.self_attn.qkv_w is None and la.mlp.gate_up_w is None for la in model.model.layers)
    model.kernels = KernelPlan(fused=True, attention=True)
    assert model.attention_kernel()  # (before: the torch path, every layer gathering its keys)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    _engine_greedy(model, hf, "paged")


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_projections_a_checkpoint_left_unquantized_stay_plain_linears(fused, tmp_path):
    """A scheme's ignore list: the checkpoint stores those projections plainly (no scale beside them).
    Layer 0 keeps only its o_proj quantized: its plain q/k/v still fuse, and the fused path (kernels'
    torch references on the CPU) multiplies o_proj by its own product, not its words as a matrix."""
    from deployments.kernels.policy import KernelPlan
    hf, cfg = hf_model("llama")
    src = quantized_checkpoint(hf, cfg, "awq", tmp_path / "hf")
    from safetensors.torch import load_file, save_file
    tensors = load_file(src / "model.safetensors")
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj"):
        base = f"model.layers.0.{proj}."
        for t in ("qweight", "qzeros", "scales"):
            del tensors[base + t]
        tensors[base + "weight"] = hf.get_parameter(base + "weight").detach().clone()  # dequantized values, fp32
    save_file(tensors, src / "model.safetensors")
    m = load(pack(src, tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    layer0 = model.model.layers[0]
    assert isinstance(layer0.mlp.down_proj, torch.nn.Linear)
    assert not isinstance(layer0.self_attn.o_proj, torch.nn.Linear)
    assert isinstance(layer0.self_attn.qkv_w, torch.Tensor) and isinstance(layer0.mlp.gate_up_w, torch.Tensor)
    if fused:
        model.kernels = KernelPlan(fused=True)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    _engine_greedy(model, hf, "paged")


def test_pack_quantize_fp8_makes_a_per_channel_pack(tmp_path):
    hf, cfg = hf_model("qwen2")
    hf.save_pretrained(tmp_path / "hf")
    dest = pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False, quantize="fp8", dtype="bfloat16"))
    pf = read_packed(dest)
    assert pf.index.metadata["quantization"]["strategy"] == "channel"
    entries = {t.name: t for t in pf.tensors}
    w = "model.layers.1.mlp.down_proj.weight"
    assert entries[w].dtype == "float8_e4m3fn" and entries[w[:-6] + "weight_scale"].dtype == "float32"
    assert entries["model.embed_tokens.weight"].dtype == "bfloat16"  # not a projection: cast, not quantized
    config = json.loads((dest / "config.json").read_text())
    assert scheme_of(config).source == "compressed-tensors"
    assert verify(dest).ok  # the rewritten config.json is the one the index lists
    m = load(dest, "cpu")
    q, s = quantize_fp8(hf.get_parameter(w).detach(), "channel")
    assert torch.equal(m.tensors[w].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(m.tensors[w[:-6] + "weight_scale"], s)
    model = build_model(m.config, m.tensors)
    with torch.no_grad():  # the fp8 model against transformers over the same dequantized weights
        for name, p in hf.named_parameters():
            if name in m.tensors and m.tensors[name].dtype == torch.float8_e4m3fn:
                p.copy_(m.tensors[name].float() * m.tensors[name[:-6] + "weight_scale"])
            elif name in m.tensors:
                p.copy_(m.tensors[name].float())
        tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
        want = hf(tokens).logits
        model = model.float()
        torch.testing.assert_close(model(tokens), want, atol=1e-3, rtol=1e-3)
    with pytest.raises(SourceError, match="quantized already"):
        pack(_quantized_src(tmp_path), tmp_path / "p2",
             PackOptions(progress=False, quantize="fp8"))


def _quantized_src(tmp_path):
    hf, cfg = hf_model("llama")
    return quantized_checkpoint(hf, cfg, "awq", tmp_path / "awq-src")


def test_a_corrupted_scale_is_refused_by_the_checksums(tmp_path):
    hf, cfg = hf_model("llama")
    src = quantized_checkpoint(hf, cfg, "ct-channel", tmp_path / "hf")
    dest = pack(src, tmp_path / "packed", PackOptions(progress=False, chunk_bytes=4096))
    victim = next(t for t in read_packed(dest).tensors if t.name.endswith("weight_scale"))
    with open(dest / "model.cst", "r+b") as f:
        f.seek(4096 + victim.offset + 1)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    report = verify(dest)
    assert not report.ok and victim.name in report.problems()[0]


@pytest.mark.parametrize("q,field", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "quantization_config.version='gemv'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config.bits=8"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({**SCHEMES["ct-channel"], "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "config_groups.g.weights is num_bits=4"),
])
def test_an_unsupported_scheme_is_refused_at_pack_naming_the_field(q, field, tmp_path):
    hf, cfg = hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
    with pytest.raises(SourceError, match=field.replace("[", r"\[").replace("(", r"\(")):
        pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False))


def test_the_transformers_fallback_refuses_a_quantized_checkpoint_naming_the_scheme():
    hf, cfg = hf_model("gpt2")
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='awq'\) cannot be served through "
                                         "transformers"):
        build_model({**cfg, "quantization_config": SCHEMES["awq"]}, {})


def test_a_scale_of_the_wrong_dtype_is_refused_naming_the_tensor(tmp_path):
    hf, cfg = hf_model("llama")
    src = quantized_checkpoint(hf, cfg, "awq", tmp_path / "hf")
    m = load(pack(src, tmp_path / "packed", PackOptions(progress=False)), "cpu")
    tensors = dict(m.tensors)
    name = "model.layers.0.mlp.up_proj.scales"
    tensors[name] = tensors[name].to(torch.int16)
    with pytest.raises(ValueError, match=rf"tensor {name} is int16; .*awq int4 .* stores it as float16"):
        build_model(m.config, tensors)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-tensor", "fbgemm-fp8", "fp8-block", "awq", "gptq", "gptq-act-order"])
def test_demo_writes_a_random_checkpoint_in_each_format_that_packs_and_serves(fmt, tmp_path):
    from weights import make_demo
    from weights.quantize import DEMO_FORMATS
    src = make_demo(tmp_path / "hf", "tiny", quant=fmt)
    assert json.loads((src / "config.json").read_text())["quantization_config"] == DEMO_FORMATS[fmt]
    m = load(pack(src, tmp_path / "packed", PackOptions(progress=False)), "cpu")
    assert m.packed.index.metadata["quantization"]["source"] == DEMO_FORMATS[fmt]["quant_method"]
    model = build_model(m.config, m.tensors)
    layer = model.model.layers[0].mlp.down_proj
    w = layer.method.dequantize(layer, torch.float32)
    assert 0.01 < w.std().item() < 0.04  # spread like the plain demo's normal(0, 0.02)
    # and centred on zero: an offset shared by every weight grows through a deep model's layers
    # (int4 nibbles of 0..15 about zero points of 8: -0.11 of the spread; a 32-layer 7B overflowed fp16)
    assert abs(w.mean().item()) < 0.03 * w.std().item()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 13]]))).all()


def test_the_cli_packs_with_quantize_and_pack_and_verify_name_the_scheme(tmp_path, capsys):
    from deployments.tools.cli import main as cli
    hf, _ = hf_model("mistral")
    hf.save_pretrained(tmp_path / "hf")
    assert cli(["pack", str(tmp_path / "hf"), str(tmp_path / "p"), "--quantize", "fp8", "-q"]) == 0
    assert "GB, compressed-tensors fp8 (per-channel scales), into" in capsys.readouterr().out
    assert cli(["verify", str(tmp_path / "p"), "-q"]) == 0
    assert "compressed-tensors fp8 (per-channel scales)" in capsys.readouterr().out
    src = quantized_checkpoint(*hf_model("llama", **{"intermediate_size": 128}), "gptq", tmp_path / "gptq")
    assert cli(["pack", str(src), str(tmp_path / "g"), "--tp", "2", "-q"]) == 0
    assert "per rank, gptq int4 (group 32, symmetric), into" in capsys.readouterr().out


def test_a_static_activation_scale_is_accepted_and_left_unread(tmp_path):
    """compressed-tensors' static fp8 activations: input_scale beside each projection (the native
    paths compute activations in the model's dtype, as transformers over the dequantized weights)."""
    from safetensors.torch import load_file, save_file
    hf, cfg = hf_model("qwen2")
    src = quantized_checkpoint(hf, cfg, "ct-tensor", tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name[: -len("weight_scale")] + "input_scale"] = torch.tensor([0.05])
    save_file(tensors, src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    (src / "config.json").write_text(json.dumps(config))
    m = load(pack(src, tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    assert model.model.layers[0].self_attn.q_proj.input_scale.item() == pytest.approx(0.05)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor", "fp8-block", "awq"])
def test_fp8_projections_fuse_over_views_of_the_buffer(scheme, tmp_path):
    """q/k/v and gate/up of an fp8 pack lie back to back (each a multiple of 4 KiB here): one fused
    layer over a view of them (scales copied), on the torch path and the fused one; int4 layers keep
    their separate products (their words pack a row's outputs together)."""
    from deployments.kernels.policy import KernelPlan
    from deployments.model.quant import QuantLinear
    hf, cfg = hf_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96 if scheme != "fp8-block" else 128, **CASES["llama"])
    src = quantized_checkpoint(hf, cfg, scheme, tmp_path / "hf")
    m = load(pack(src, tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    if scheme == "awq":
        assert attn.qkv_w is None and mlp.gate_up_w is None
    else:
        assert isinstance(attn.qkv_w, QuantLinear) and isinstance(mlp.gate_up_w, QuantLinear)
        assert attn.qkv_w.weight.data_ptr() == attn.q_proj.weight.data_ptr()
        assert attn.qkv_w.weight.untyped_storage().data_ptr() == m.buffer.untyped_storage().data_ptr()
        assert "qkv_w" not in dict(attn.named_children())  # not a second entry in parameters()
        # a build over a buffer still loading copies the scales again once the bytes arrived
        scale = getattr(attn.qkv_w, attn.qkv_w.method.marker)
        scale.zero_()
        model.weights_loaded()
        assert scale.abs().min() > 0
    from deployments.model.build import gemv_groups
    assert all(w.dtype == torch.float32 for pairs in gemv_groups(model).values() for w, _ in pairs)  # lm_head's
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
        model.kernels = KernelPlan(fused=True)
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    _engine_greedy(model, hf, "paged", steps=16)


@pytest.mark.parametrize("fmt", ["fp8", "gptq-act-order"])
def test_a_replica_starts_warms_and_answers_from_a_quantized_pack(fmt, tmp_path):
    """The replica's own start (no Ray): load, build, warm-up, health, an HTTP answer."""
    from starlette.testclient import TestClient

    from deployments.server.http import build
    from deployments.server.replica import LLMServer
    from weights import make_demo
    packed = pack(make_demo(tmp_path / "hf", "tiny", quant=fmt), tmp_path / "packed", PackOptions(progress=False))
    s = LLMServer(str(packed), engine={"max_slots": 2, "max_seq_len": 128})
    try:
        s.reconfigure({"warmup": {"requests": 1}})
        s.check_health()
        r = TestClient(build(s)).post("/generate", json={"prompt": "hi", "max_new_tokens": 4})
        assert r.status_code == 200, r.text
    finally:
        s.shutdown()


@gpu
@pytest.mark.parametrize("fmt", ["fp8", "awq"])
def test_gpu_replica_built_during_the_load_serves_what_a_sequential_start_serves(fmt, tmp_path):
    """On the GPU the engine is built over the buffer while it loads (kernel self-tests on synthetic
    layers, fused layers' scales copied again once the bytes arrived): it serves what a replica that
    waited serves."""
    from deployments.server.start import Start
    from test_replica_start import _gpu_replica_run
    from weights import make_demo

    class Sequential(Start):
        def start_load(self) -> None:
            super().start_load()
            self.overlap = False
    packed = pack(make_demo(tmp_path / "hf", "tiny", quant=fmt), tmp_path / "packed", PackOptions(progress=False))
    assert _gpu_replica_run(packed)[0] == _gpu_replica_run(packed, start=Sequential)[0]


def test_pack_quantize_refuses_a_checkpoint_without_layer_projections(tmp_path):
    hf, _ = hf_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=97)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(SourceError, match=r"--quantize fp8: no layer projections to quantize \(model\.layers\.N"):
        pack(tmp_path / "hf", tmp_path / "p", PackOptions(progress=False, quantize="fp8"))


def test_scales_of_another_group_size_are_named_by_the_strict_check(tmp_path):
    hf, cfg = hf_model("llama")
    src = quantized_checkpoint(hf, cfg, "awq", tmp_path / "hf")  # group 32
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (src / "config.json").write_text(json.dumps(config))
    m = load(pack(src, tmp_path / "packed", PackOptions(progress=False)), "cpu")
    with pytest.raises(ValueError, match=r"mis-shaped \(\d+\): model.layers.0.mlp.down_proj.qzeros: expected "
                                         r"\[2, 8\], given \[3, 8\]"):
        build_model(m.config, m.tensors)


def test_gptq_without_act_order_gives_the_kernels_no_g_idx_and_pack_checks_it(tmp_path):
    """GPTQ writes a g_idx even without act-order; there it is k // group_size, which pack checks,
    and the kernels are not given it (their group tiles read one row of scales per group)."""
    from safetensors.torch import load_file, save_file
    hf, cfg = hf_model("llama")
    src = quantized_checkpoint(hf, cfg, "gptq", tmp_path / "hf")
    m = load(pack(src, tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.g_idx is not None and layer.method.spec(layer).g_idx is None
    act = quantized_checkpoint(*hf_model("llama"), "gptq-act-order", tmp_path / "act")
    m = load(pack(act, tmp_path / "packed-act", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.method.spec(layer).g_idx is not None
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(SourceError, match=rf"tensor '{name}' orders the input rows' groups otherwise .*desc_act"):
        pack(src, tmp_path / "packed-bad", PackOptions(progress=False))
    assert not (tmp_path / "packed-bad").exists()
