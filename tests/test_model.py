"""Native decoder vs transformers on tiny random checkpoints (CPU, fp32)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deployments.model import ModelConfig, build_model, build_native
from helpers_engine import engine_greedy_matches_transformers, hf_greedy, random_biases, state_tensors
from helpers_engine import hf_model as _hf_model


def hf_model(arch: str = "llama", **overrides):
    """helpers_engine.hf_model, given copies: transformers' config writes into the rope dict it
    is handed (rope_theta, original_max_position_embeddings), which would leak between tests."""
    return _hf_model(arch, **copy.deepcopy(overrides))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-head-dim": ("llama", {"head_dim": 32}),
    "mistral-window": ("mistral", {"sliding_window": 5}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    # the hidden-field audit (deployments/model/config.py's docstring): fields honoured natively
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),
    "llama-rms-norm-eps": ("llama", {"rms_norm_eps": 1e-2}),
    "llama-rope-theta": ("llama", {"rope_theta": 100.0}),
    "llama-dynamic-rope": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}),
    "llama-gelu-tanh": ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    "llama-swish": ("llama", {"hidden_act": "swish"}),
    "qwen2-gelu": ("qwen2", {"hidden_act": "gelu"}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "qwen2-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "qwen2-layer-types": ("qwen2", {"use_sliding_window": True, "sliding_window": 5,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    # fields transformers' class does not read either (unread_fields): served natively, the same logits
    "mistral-bias-fields": ("mistral", {"attention_bias": True, "mlp_bias": True}),
    "qwen2-bias-fields": ("qwen2", {"attention_bias": True, "mlp_bias": True}),
    "mistral-qwen2-window-fields": ("mistral", {"sliding_window": 3, "use_sliding_window": False,
                                                "max_window_layers": 1,
                                                "layer_types": ["sliding_attention", "full_attention"]}),
    "llama-foreign-fields": ("llama", {"final_logit_softcapping": 1.0, "attn_logit_softcapping": 5.0,
                                       "query_pre_attn_scalar": 7, "embedding_multiplier": 3.0, "logits_scaling": 4.0,
                                       "sliding_window": 3, "partial_rotary_factor": 0.5}),
}


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case):
    arch, kw = CASES[case]
    hf, cfg = hf_model(arch, **kw)
    random_biases(hf)
    model = build_model(cfg, state_tensors(hf))
    assert type(model).__name__ == "Transformer"  # served natively
    tokens = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    ref = hf(tokens).logits.detach()
    got = _logits(model, tokens)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_llama3_scaling_is_not_a_noop():
    # guards the test above: without the llama3 rules the logits must differ
    hf, cfg = hf_model("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    plain = dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=None)
    tokens = torch.arange(16).view(1, 16) % cfg["vocab_size"]
    a = _logits(build_model(cfg, state_tensors(hf)), tokens)
    b = _logits(build_model(plain, state_tensors(hf)), tokens)
    assert (a - b).abs().max() > 1e-3


def test_qkv_bias_is_used():
    hf, cfg = hf_model("qwen2")
    t = state_tensors(hf)
    assert "model.layers.0.self_attn.q_proj.bias" in t
    with torch.no_grad():
        hf.model.layers[0].self_attn.q_proj.bias.add_(1.0)
    tokens = torch.arange(8).view(1, 8)
    torch.testing.assert_close(_logits(build_model(cfg, state_tensors(hf)), tokens), hf(tokens).logits.detach(), atol=1e-4, rtol=1e-4)


def test_tied_lm_head_may_be_absent():
    hf, cfg = hf_model("qwen2", tie_word_embeddings=True)
    t = state_tensors(hf)
    t.pop("lm_head.weight", None)
    model = build_model(cfg, t)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tensors_are_assigned_not_copied():
    hf, cfg = hf_model("llama")
    t = state_tensors(hf)
    model = build_model(cfg, t)
    assert model.model.layers[1].mlp.up_proj.weight.data_ptr() == t["model.layers.1.mlp.up_proj.weight"].data_ptr()
    assert model.model.embed_tokens.weight.data_ptr() == t["model.embed_tokens.weight"].data_ptr()
    assert not any(p.requires_grad for p in model.parameters())


def test_strict_check_lists_missing_unexpected_misshaped():
    hf, cfg = hf_model("llama")
    t = state_tensors(hf)
    del t["model.layers.0.mlp.gate_proj.weight"]
    t["model.layers.0.extra.weight"] = torch.zeros(3)
    t["model.norm.weight"] = torch.zeros(7)
    with pytest.raises(ValueError) as err:
        build_native(cfg, t)
    msg = str(err.value)
    assert "missing (1): model.layers.0.mlp.gate_proj.weight" in msg
    assert "unexpected (1): model.layers.0.extra.weight" in msg
    assert "model.norm.weight: expected [64], given [7]" in msg


def test_old_checkpoint_inv_freq_is_ignored():
    hf, cfg = hf_model("llama")
    t = state_tensors(hf)
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    build_native(cfg, t)


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_parameters.rope_type='yarn'"),
        ({"rope_parameters": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ],
)
def test_bad_config_names_the_field(patch, field):
    _, cfg = hf_model("llama")
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_hf({**cfg, **patch})


def test_old_style_rope_scaling_config():
    cfg = ModelConfig.from_hf(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
         "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    assert (cfg.rope_type, cfg.rope_theta, cfg.head_dim, cfg.num_key_value_heads) == ("linear", 500000.0, 4, 2)


def test_fallback_serves_gpt2_through_transformers():
    hf, cfg = hf_model("gpt2", vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    model = build_model(cfg, state_tensors(hf))
    assert type(model).__name__ == "HFModel" and not model.supports_cuda_graphs
    tokens = torch.arange(10).view(1, 10)
    torch.testing.assert_close(_logits(model, tokens), hf(tokens).logits.detach(), atol=1e-5, rtol=1e-5)


def test_engine_modules_do_not_import_transformers():
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, torch;"
        "import deployments.model, deployments.engine.engine, deployments.engine.tokenizer;"
        "print([m for m in ('transformers','ray','jinja2') if m in sys.modules])"
    )
    # (the import time itself is measured in bench/engine.py, not asserted here)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window", "qwen2-tied"])
def test_cached_prefill_and_decode_logits_equal_full_forward(case):
    # tight check of the KV-cache path: chunked prefill into slot 1, then decode steps
    # with padding rows 0 and 2 around it, against a plain causal forward
    arch, kw = CASES[case]
    hf, cfg = hf_model(arch, **kw)
    model = build_model(cfg, state_tensors(hf))
    seq = torch.randint(0, cfg["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(seq)[0]  # [S, V]
        cache = model.new_cache(3, 32)
        model.prefill(seq[:, :5], cache, 1, 0)
        last = model.prefill(seq[:, 5:12], cache, 1, 5)
        torch.testing.assert_close(last, full[11], atol=1e-5, rtol=1e-5)
        for p in range(12, 20):
            tokens = torch.tensor([0, seq[0, p].item(), 0])
            positions = torch.tensor([31, p, 31])
            valid = torch.tensor([False, True, False])
            logits = model.decode(tokens, positions, valid, cache, 24 if p < 24 else 32)
            torch.testing.assert_close(logits[1], full[p], atol=1e-5, rtol=1e-5)
            assert torch.isfinite(logits).all()


def test_building_the_model_imports_nothing_heavy(tiny_packed):
    # torch.nn.init.normal_ pulls in torch._dynamo and sympy (1-2 s of every replica start);
    # the model is built without running any initialiser
    code = (
        "import sys, torch\n"
        "from weights import load\n"
        "from deployments.model import build_model\n"
        f"m = load({str(tiny_packed)!r}, 'cpu')\n"
        "before = set(sys.modules)\n"
        "build_model(m.config, m.tensors)\n"
        "new = sorted(n for n in set(sys.modules) - before if n.split('.')[0] in ('sympy',) "
        "or n.startswith(('torch._dynamo', 'torch._inductor')))\n"
        "assert not new, new[:10]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-untied", "mistral-window"])
def test_packed_checkpoint_fuses_projections_without_copies_and_matches_transformers(case, tmp_path):
    """The real pipeline: save_pretrained -> coldstart pack -> load -> native model."""
    from weights import PackOptions, load, pack

    arch, kw = CASES[case]
    hf, cfg = hf_model(arch, **kw)
    hf.save_pretrained(tmp_path / "hf")
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    # the packer put q/k/v and gate/up side by side: the fused weights are views, not copies
    assert attn.qkv_w is not None and attn.qkv_w.data_ptr() == attn.q_proj.weight.data_ptr()
    assert mlp.gate_up_w is not None and mlp.gate_up_w.data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert attn.qkv_w.untyped_storage().data_ptr() == m.buffer.untyped_storage().data_ptr()
    torch.testing.assert_close(attn.qkv_w[-attn.n_kv * attn.head_dim:], attn.v_proj.weight, rtol=0, atol=0)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, tokens), hf(tokens).logits.detach(), atol=1e-4, rtol=1e-4)
    # and through the engine's cached prefill / decode, batched: greedy equals transformers'
    _engine_greedy_equals_transformers(model, hf)


def _engine_greedy_equals_transformers(model, hf) -> None:
    stats = engine_greedy_matches_transformers(model, hf, timeout=60)
    if model.device.type == "cuda":
        assert stats["graphs"] > 0


def test_adjacent_view_refuses_tensors_that_are_not_back_to_back():
    from deployments.model.fused import adjacent_view

    buf = torch.arange(24, dtype=torch.float32)
    a, b = buf[:8].view(2, 4), buf[8:16].view(2, 4)
    fused = adjacent_view([a, b])
    assert fused is not None and fused.shape == (4, 4) and fused.data_ptr() == a.data_ptr()
    assert adjacent_view([a, buf[12:20].view(2, 4)]) is None     # a gap
    assert adjacent_view([b, a]) is None                         # wrong order
    assert adjacent_view([a, torch.zeros(2, 4)]) is None         # another storage


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["torch", "triton", "auto"])
@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-untied", "mistral-window"])
def test_triton_decode_path_matches_transformers_on_the_gpu(case, mode, tmp_path, monkeypatch):
    """Packed model on CUDA: the fused kernels (norm, SwiGLU, rope + KV write; the decode
    attention and the GEMV for every step (triton), where measured faster (auto) or never
    (torch)) inside CUDA graphs give transformers' greedy tokens, and the same logits as
    the torch path."""
    import dataclasses

    from deployments.kernels import ops
    from deployments.kernels.policy import KernelPlan
    from deployments.model.build import gemv_groups
    from weights import PackOptions, load, pack

    pytest.importorskip("triton")
    arch, kw = CASES[case]
    hf, cfg = hf_model(arch, **kw)
    hf.save_pretrained(tmp_path / "hf")
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cuda")
    model = build_model(m.config, m.tensors)
    assert model.kernels.fused and ops.available("cuda") and model.kernels.attention
    shapes = frozenset(tuple(pairs[0][0].shape) for pairs in gemv_groups(model).values())
    if mode != "auto":  # every projection through the GEMV and the Triton attention, or neither
        model.kernels = dataclasses.replace(model.kernels, attention=mode == "triton",
                                            gemv=shapes if mode == "triton" else frozenset())
    tokens = torch.randint(0, cfg["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2)).cuda()
    fused = model(tokens)
    plan = model.kernels
    model.kernels = KernelPlan()
    torch.testing.assert_close(fused, model(tokens), atol=1e-4, rtol=1e-4)
    model.kernels = plan
    _engine_greedy_equals_transformers(model, hf)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_attention_kernel_serves_every_decode_step_with_one_key_bound(heads, tmp_path):
    """The Triton attention, once it passed its self-test, takes every decode step, grouped-query
    heads or not; a step through it needs one graph per batch size (each row reads its keys up
    to its own position), a step through the matmuls one per key-length bucket."""
    from weights import PackOptions, load, pack

    hf, cfg = hf_model("llama", num_attention_heads=heads[0], num_key_value_heads=heads[1])
    hf.save_pretrained(tmp_path / "hf")  # packed: q, k, v side by side, so the fused decode path applies
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    buckets = (512, 2048, 4096)
    assert not model.attention_kernel()  # not enabled (CPU)
    assert model.decode_kv_lens(buckets) == buckets
    from deployments.kernels.policy import KernelPlan
    model.kernels = KernelPlan(fused=True, attention=True)  # (on CPU the kernels' torch references run)
    assert model.attention_kernel()
    assert model.decode_kv_lens(buckets) == (4096,)
    # a layer whose q, k, v are apart (an int4 scheme's): its three products joined, the same path
    model.model.layers[1].self_attn.qkv_w = None
    model.model.layers[1].mlp.gate_up_w = None
    assert model.attention_kernel() and model.decode_kv_lens(buckets) == (4096,)
    _engine_greedy_equals_transformers(model, hf)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads,lazy", [((4, 2), False), ((4, 4), False), ((4, 2), True)])
def test_one_graph_per_batch_size_where_the_attention_reads_to_each_position(heads, lazy, tmp_path):
    """The decode steps go through the Triton attention (every row reads its keys up to its
    own position): the engine captures one graph per batch size, at the longest key length.
    Greedy tokens equal transformers' for prompts whose decode crosses the smaller buckets,
    alone and batched (lazy: batch 4's graph captured by the step that first needs it)."""
    from deployments.engine import Engine, EngineConfig, SamplingParams
    from weights import PackOptions, load, pack

    pytest.importorskip("triton")
    hf, cfg = hf_model("llama", num_attention_heads=heads[0], num_key_value_heads=heads[1])
    hf.save_pretrained(tmp_path / "hf")
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cuda")
    model = build_model(m.config, m.tensors)
    assert model.kernels.attention
    eng = Engine(model, None, EngineConfig(max_slots=4, max_seq_len=128, prefill_chunk=16, kv_len_buckets=(24, 48),
                                           lazy_graphs=lazy))
    eng.start()
    try:
        # batch sizes 1, 2, 4, each at the longest key length (lazy: batch 1's alone so far)
        assert eng.stats()["graphs"] == (1 if lazy else 3)
        prompts = [[3, 5, 7, 11, 13] * 4, [9] * 7, [2, 4] * 10]
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        alone = eng.generate(prompts[0], params)[0]
        batched = [h.result(timeout=60)[0] for h in [eng.submit(p, params) for p in prompts]]
        if lazy:  # batch 4's graph (three rows), and batch 2's where one prompt decoded before the others
            late = eng.stats()["late_captures"]
            assert 4 in late and {why for _, why in late.values()} == {"step"}, late
    finally:
        eng.shutdown()
    assert alone == batched[0] == hf_greedy(hf, prompts[0], 40)
    assert batched[1:] == [hf_greedy(hf, p, 40) for p in prompts[1:]]


def test_model_decodes_with_torch_kernels_when_triton_fails(monkeypatch, caplog):
    """A Triton that cannot compile (no C compiler in the image, say) must not stop the
    replica: the self-test at build time catches it and the torch path serves."""
    from deployments.kernels import ops

    def no_compiler(*a, **k):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(ops, "available", lambda device: True)
    monkeypatch.setattr(ops, "_launch_add_rms_norm", no_compiler)
    hf, cfg = hf_model("llama")
    with caplog.at_level("WARNING", logger="deployments.kernels.policy"):
        model = build_model(cfg, state_tensors(hf))
    assert not model.kernels.fused
    assert "fused Triton kernels off (RuntimeError: Failed to find C compiler" in caplog.text
    tokens = torch.randint(0, cfg["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(tokens), hf(tokens).logits.detach(), atol=1e-4, rtol=1e-4)


def test_a_model_built_before_its_weights_arrived_serves_the_arrived_ones(tmp_path):
    """A replica builds the model over the load's buffer while the bytes are still arriving.
    Here the buffer holds zeros at build time and the real bytes afterwards; once
    weights_loaded() has run, logits and the engine's greedy tokens are transformers'. Qwen2's
    q/k/v biases lie 4 KiB apart in a packed file, so the build copied them: a stale copy
    would change the logits."""
    from weights import PackOptions, load, pack

    hf, cfg = hf_model("qwen2", tie_word_embeddings=False)
    with torch.no_grad():  # biases that matter
        for layer in hf.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 1.0)
            layer.self_attn.k_proj.bias.normal_(0, 1.0)
    hf.save_pretrained(tmp_path / "hf")
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cpu")
    arrived = m.buffer.clone()
    m.buffer.zero_()  # copy-on-write map: the file stays as it is
    model = build_model(m.config, m.tensors)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_b is not None and attn.qkv_b.data_ptr() != attn.q_proj.bias.data_ptr()  # a copy
    held = attn.qkv_b.data_ptr()
    m.buffer.copy_(arrived)
    tokens = torch.randint(0, cfg["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(3))
    ref = hf(tokens).logits.detach()
    assert not torch.allclose(_logits(model, tokens), ref, atol=1e-3)  # the stale copy shows
    model.weights_loaded()
    assert attn.qkv_b.data_ptr() == held  # in place: captured graphs keep their addresses
    torch.testing.assert_close(_logits(model, tokens), ref, atol=1e-4, rtol=1e-4)
    _engine_greedy_equals_transformers(model, hf)


def test_kv_cache_is_one_block_of_contiguous_layer_views():
    """Every layer's keys and values live in one allocation (one memset clears them all),
    each layer's k and v a contiguous view of its own part."""
    from deployments.model import KVCache, ModelConfig

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
                               "vocab_size": 50, "max_position_embeddings": 64})
    cache = KVCache(cfg, 2, 16, torch.float32, torch.device("cpu"))
    layers = cache.k + cache.v
    assert len(layers) == 6 and all(t.shape == (2, 2, 16, 16) and t.is_contiguous() for t in layers)
    base, size = cache.data.data_ptr(), cache.data.numel() * cache.data.element_size()
    starts = sorted(t.data_ptr() for t in layers)
    assert all(base <= p < base + size for p in starts) and len(set(starts)) == 6  # no two layers share
    assert cache.data.count_nonzero() == 0
    cache.k[2][1, 0, 5] = 1.0
    cache.v[0][0, 1, 15, 3] = float("nan")
    assert cache.data.isnan().sum() == 1 and cache.data[0, 2, 1, 0, 5].eq(1).all()
    cache.zero_()
    assert cache.data.count_nonzero() == 0 and not cache.data.isnan().any()


# ----------------------------------------------------------------------------- the hidden-field audit
# deployments/model/config.py's docstring lists every config.json field checked and its verdict.


def _same_as_transformers(model, hf, seq=16):
    tokens = torch.randint(0, hf.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, tokens), hf(tokens).logits.detach(), atol=1e-4, rtol=1e-4)


def _differs_from_transformers(model, hf, seq=16):
    tokens = torch.randint(0, hf.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    return (_logits(model, tokens) - hf(tokens).logits.detach()).abs().max().item() > 1e-3


def _transformers_reads(cfg):
    """The config object transformers makes of a config.json dict (what its class computes from)."""
    import transformers

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(cfg["model_type"], **kw)


@pytest.mark.parametrize("case, revert", [
    ("llama-rms-norm-eps", {"rms_norm_eps": 1e-6}),
    ("llama-rope-theta", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    ("llama-gelu-tanh", {"hidden_act": "silu"}),
    ("qwen2-gelu", {"hidden_act": "silu"}),
    ("qwen2-window-layers", {"use_sliding_window": False}),
    ("qwen2-layer-types", {"layer_types": ["full_attention", "sliding_attention"]}),
    ("mistral-no-window", {"sliding_window": 3}),
])
def test_the_honoured_fields_change_the_logits(case, revert):
    # guards test_logits_match_transformers: with the field read otherwise, the logits differ
    arch, kw = CASES[case]
    hf, cfg = hf_model(arch, **kw)
    assert _differs_from_transformers(build_model({**cfg, **revert}, state_tensors(hf)), hf)


def test_the_bug_a_gelu_llama_is_served_natively_with_gelu(tmp_path, caplog):
    """A Llama config.json with hidden_act gelu_pytorch_tanh was served with SiLU, silently. Now the
    native MLP computes the config's activation, on the torch path and on the fused path (whose
    Triton SwiGLU kernel is SiLU only: there, on the CPU, its torch reference would run), and
    the build says so."""
    from weights import PackOptions, load, pack

    hf, cfg = hf_model("llama", hidden_act="gelu_pytorch_tanh")
    hf.save_pretrained(tmp_path / "hf")  # packed: gate and up side by side, so the fused MLP branch applies
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cpu")
    with caplog.at_level("INFO", logger="deployments.model"):
        model = build_model(m.config, m.tensors)
    assert type(model).__name__ == "Transformer" and model.model.layers[0].mlp.gate_up_w is not None
    assert "hidden_act='gelu_pytorch_tanh'" in caplog.text
    _same_as_transformers(model, hf)
    from deployments.kernels.policy import KernelPlan
    model.kernels = KernelPlan(fused=True)  # the fused path's branches (the kernels' torch references on the CPU)
    _same_as_transformers(model, hf)
    model.kernels = KernelPlan()
    _engine_greedy_equals_transformers(model, hf)
    silu = build_model({**cfg, "hidden_act": "silu"}, state_tensors(hf))
    assert _differs_from_transformers(silu, hf)  # the bug's model: what SiLU gave


def test_llama3_original_max_position_embeddings_is_read_as_transformers_reads_it():
    # a hub config.json may lack it (transformers: max_position_embeddings, not 8192) or give it at the
    # top level as well (transformers: the top-level value wins); transformers' model is built from
    # those raw forms, but writes its config.json normalised, so the raw forms are given here again
    no_original = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    hf, cfg = hf_model("llama", rope_scaling=no_original)
    assert hf.config.rope_parameters["original_max_position_embeddings"] == cfg["max_position_embeddings"] == 256
    raw = {**cfg, "rope_parameters": {**no_original, "rope_theta": 10000.0}}
    _same_as_transformers(build_model(raw, state_tensors(hf)), hf)
    old_default = {**raw, "rope_parameters": {**raw["rope_parameters"], "original_max_position_embeddings": 8192}}
    assert _differs_from_transformers(build_model(old_default, state_tensors(hf)), hf)

    hf, cfg = hf_model("llama", rope_scaling=LLAMA3_ROPE, original_max_position_embeddings=16)
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 16  # its rope took the top-level value
    raw = {**cfg, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 10000.0}}  # 64 in the dict, 16 at the top
    _same_as_transformers(build_model(raw, state_tensors(hf)), hf)
    assert _differs_from_transformers(build_model({k: v for k, v in raw.items()
                                                   if k != "original_max_position_embeddings"}, state_tensors(hf)), hf)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    hf, cfg = hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    both = {**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}}
    assert _transformers_reads(both).rope_parameters["factor"] == 2.0
    _same_as_transformers(build_model(both, state_tensors(hf)), hf)


def test_old_style_config_with_top_level_rope_theta_matches_transformers():
    hf, cfg = hf_model("qwen2", rope_theta=100.0, rope_scaling={"type": "linear", "factor": 2.0})
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    old.update(rope_theta=100.0, rope_scaling={"type": "linear", "factor": 2.0})
    _same_as_transformers(build_model(old, state_tensors(hf)), hf)


@pytest.mark.parametrize("arch, extra, windows", [
    ("mistral", {}, [4096, 4096]),  # MistralConfig's default when the key is absent
    ("mistral", {"sliding_window": None}, [None, None]),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, [None, 4096]),
    ("qwen2", {"use_sliding_window": False, "max_window_layers": 1}, [None, None]),
])
def test_sliding_window_defaults_are_transformers(arch, extra, windows):
    _, cfg = hf_model(arch)
    raw = {k: v for k, v in cfg.items() if k not in ("sliding_window", "layer_types", "use_sliding_window")}
    raw.update(extra)
    assert ModelConfig.from_hf(raw).layer_windows == windows
    read = _transformers_reads(raw)
    assert [read.sliding_window if t == "sliding_attention" or arch == "mistral" else None
            for t in getattr(read, "layer_types", None) or ["?"] * 2] == windows


BLOCKED = {
    "gelu-new": ("llama", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    "quick-gelu": ("qwen2", {"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu'"),
    "yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                           "rope_theta": 10000.0}}, "rope_parameters.rope_type='yarn'"),
    "longrope": ("llama", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                            "original_max_position_embeddings": 64}},
                 "rope_scaling.rope_type='longrope'"),
    "mrope": ("qwen2", {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
              "rope_scaling.rope_type='mrope'"),
    "nested-rope": ("qwen2", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
                    "rope_parameters is nested by layer type (full_attention, sliding_attention)"),
    "partial-rotary-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                            "partial_rotary_factor": 0.5}},
                              "partial_rotary_factor=0.5 with rope_type 'linear'"),
    "partial-rotary-top-level": ("mistral", {"partial_rotary_factor": 0.25, "rope_scaling": LLAMA3_ROPE},
                                 "partial_rotary_factor=0.25 with rope_type 'llama3'"),
    "bidirectional": ("llama", {"is_causal": False}, "is_causal=False"),
    "qwen2-layer-type": ("qwen2", {"layer_types": ["chunked_attention", "full_attention"]},
                         "layer_types has 'chunked_attention'"),
    "architecture": ("gpt2", {}, "has no native implementation"),
}


@pytest.mark.parametrize("case", BLOCKED)
def test_native_blockers_name_the_field_and_from_hf_refuses_it(case):
    from deployments.model.config import is_native, native_blockers

    arch, patch, reason = BLOCKED[case]
    base = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"} if arch == "gpt2" else hf_model(arch)[1]
    cfg = {**base, **patch}
    why = native_blockers(cfg)
    assert len(why) == 1 and reason in why[0], why
    assert not is_native(cfg)
    with pytest.raises(ValueError, match=re.escape(reason)):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("arch, patch", [
    ("llama", {}), ("mistral", {}), ("qwen2", {}),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}), ("qwen2", {"hidden_act": "swish"}),
    ("llama", {"rope_scaling": LLAMA3_ROPE}), ("mistral", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    ("llama", {"partial_rotary_factor": 0.5}),  # the default rope ignores it, in transformers too
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["attention", "sliding_attention"]}),
    ("llama", {"is_causal": True}),
])
def test_native_configs_have_no_blockers(arch, patch):
    from deployments.model.config import is_native, native_blockers

    cfg = {**hf_model(arch)[1], **patch}
    assert native_blockers(cfg) == [] and is_native(cfg)
    ModelConfig.from_hf(cfg)


def test_unread_fields_name_what_transformers_ignores_too(caplog):
    from deployments.model.config import unread_fields

    arch, kw = CASES["llama-foreign-fields"]
    hf, cfg = hf_model(arch, **kw)
    cfg = {**cfg, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"},
           "rope_parameters": {**cfg["rope_parameters"], "mrope_section": [2, 3, 3]}}
    text = "; ".join(unread_fields(cfg))
    for name in ("final_logit_softcapping=1.0", "attn_logit_softcapping=5.0", "query_pre_attn_scalar=7",
                 "embedding_multiplier=3.0", "logits_scaling=4.0", "sliding_window=3", "partial_rotary_factor=0.5",
                 "auto_map=", "mrope_section=[2, 3, 3]"):
        assert name in text, name
    with caplog.at_level("WARNING"):
        model = build_model(cfg, state_tensors(hf))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "final_logit_softcapping=1.0" in warned[0] and "does not read either" in warned[0]
    assert type(model).__name__ == "Transformer"
    _same_as_transformers(model, hf)
    assert unread_fields(hf_model("llama")[1]) == [] and unread_fields(hf_model("qwen2")[1]) == []
    _, mistral = hf_model("mistral", attention_bias=True, mlp_bias=True, use_sliding_window=False)
    text = "; ".join(unread_fields(mistral))
    assert "attention_bias=True (MistralForCausalLM has no biases)" in text and "use_sliding_window=False" in text
    arch, kw = CASES["mistral-qwen2-window-fields"]
    text = "; ".join(unread_fields(hf_model(arch, **kw)[1]))
    assert "layer_types=['sliding_attention', 'full_attention']" in text and "windows every layer" in text


@pytest.mark.parametrize("arch, kw, reason", [
    ("llama", {"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu'"),
    ("qwen2", BLOCKED["yarn"][1], "rope_parameters.rope_type='yarn'"),
    ("llama", {"is_causal": False}, "is_causal=False"),
])
def test_blocked_configs_are_served_by_transformers_with_one_warning(arch, kw, reason, caplog):
    hf, cfg = hf_model(arch, **kw)
    with caplog.at_level("WARNING"):
        model = build_model(cfg, state_tensors(hf))
    assert type(model).__name__ == "HFModel"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and reason in warned[0] and "through transformers" in warned[0], warned
    _same_as_transformers(model, hf)
    if kw.get("is_causal", True):  # the serving path: cached prefill and decode steps, greedy
        _engine_greedy_equals_transformers(model, hf)


def test_a_rope_type_transformers_cannot_build_either_is_refused_naming_the_field():
    hf, cfg = hf_model("qwen2")
    cfg = {**cfg, "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=r"not served natively \(rope_parameters\.rope_type='mrope'.*"
                                         r"transformers could not build it either: KeyError"):
        build_model(cfg, state_tensors(hf))


def test_quantized_configs_of_an_unread_scheme_are_refused_naming_the_field():
    _, cfg = hf_model("llama")
    with pytest.raises(ValueError, match=r"quantization_config.quant_method='bitsandbytes' is not supported"):
        ModelConfig.from_hf({**cfg, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    block = ModelConfig.from_hf({**cfg, "quantization_config": {"quant_method": "fp8",
                                                                "weight_block_size": [128, 128]}})
    assert block.quantization.block == (128, 128)  # (read: deployments.model.quant runs it)
