"""Split packs of quantized checkpoints (``weights.tp``'s rules for a projection's scales, zero
points and packed words): each rank's slice dequantizes to the rank's slice of the dequantized
weight, a split that would cut a group (or a word, or a block) is refused naming the field, and
the ranks of a split AWQ pack compute what one device computes."""

from __future__ import annotations

import pytest
import torch

from deployments.model.quant import QuantLinear, method_for
from helpers_engine import hf_greedy, hf_model
from helpers_quant import quantized_checkpoint
from weights import PackOptions, SourceError, load, pack
from weights.quant import scheme_of
from weights.tp import layout, shard

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def _dequantized(tensors: dict, base: str, method, n: int, k: int) -> torch.Tensor:
    layer = QuantLinear(method, k, n, False, tuple(t for t in method.optional if f"{base}.{t}" not in tensors))
    for name in method.tensors(n, k):
        if f"{base}.{name}" in tensors:
            setattr(layer, name, torch.nn.Parameter(tensors[f"{base}.{name}"], requires_grad=False))
    return method.dequantize(layer, torch.float32)


@pytest.mark.parametrize("scheme", ["ct-channel", "ct-tensor", "fp8-block", "awq", "gptq", "gptq-v2", "--quantize"])
def test_each_ranks_slices_dequantize_to_its_slice_of_the_weight(scheme, tmp_path):
    hf, cfg = hf_model("llama", **SIZES)
    quantize = "fp8" if scheme == "--quantize" else None  # an fp16 checkpoint quantized as it is split
    if quantize:
        hf.save_pretrained(tmp_path / "hf")
        src = tmp_path / "hf"
    else:
        src = quantized_checkpoint(hf, cfg, scheme, tmp_path / "hf")
    dest = pack(src, tmp_path / "tp2", PackOptions(progress=False, tp=2, quantize=quantize))
    whole = load(pack(src, tmp_path / "one", PackOptions(progress=False, quantize=quantize)), "cpu")
    config = whole.config
    lay, method = layout(config, 2), method_for(scheme_of(config))
    for rank in range(2):
        part = load(dest, "cpu", rank=rank).tensors
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            base = f"model.layers.1.{proj}"
            full = _dequantized(whole.tensors, base, method, *hf.get_parameter(base + ".weight").shape)
            want = shard(base + ".weight", full, lay, rank)
            assert torch.equal(_dequantized(part, base, method, *want.shape), want), (base, rank)


@pytest.mark.parametrize("scheme,sizes,field", [
    ("awq", dict(intermediate_size=96), "quantization_config.group_size"),  # down_proj: 48 input columns a rank
    ("fp8-block", dict(intermediate_size=96), "quantization_config.weight_block_size"),
    ("gptq-act-order", {}, "quantization_config.desc_act=True"),
])
def test_a_split_that_would_cut_a_group_is_refused_naming_the_field(scheme, sizes, field, tmp_path):
    hf, cfg = hf_model("llama", **{**SIZES, **sizes})
    src = quantized_checkpoint(hf, cfg, scheme, tmp_path / "hf")
    with pytest.raises(SourceError, match=field):
        pack(src, tmp_path / "tp2", PackOptions(progress=False, tp=2))


def test_the_ranks_of_a_split_awq_pack_compute_what_one_device_computes(tmp_path):
    from deployments.model import build_model
    from helpers_tp import model_runs, rank_model_runs, run_ranks
    hf, cfg = hf_model("llama", **SIZES)
    src = quantized_checkpoint(hf, cfg, "awq", tmp_path / "hf")
    pack(src, tmp_path / "tp2", PackOptions(progress=False, tp=2))
    m = load(pack(src, tmp_path / "one", PackOptions(progress=False)), "cpu")
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    prompts, steps = [[3, 5, 7, 11, 13, 17], [9] * 7, [2, 4, 6]], 8
    one = model_runs(build_model(m.config, m.tensors), tokens, prompts, steps)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(2, rank_model_runs, {"jobs": [("awq", 2, str(tmp_path / "tp2"))], "out": str(out), "tokens": tokens,
                                   "prompts": prompts, "steps": steps})
    ranks = [torch.load(out / f"awq-tp2-rank{r}.pt") for r in range(2)]
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    torch.testing.assert_close(ranks[0]["logits"], one["logits"], atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ranks[0]["logits"], hf(tokens).logits, atol=1e-4, rtol=1e-4)
    assert ranks[0]["greedy"] == ranks[0]["greedy_fused"] == one["greedy"] == [hf_greedy(hf, p, steps) for p in prompts]
