"""Quantized checkpoints made by the tests: a tiny transformers model's projections quantized
in each scheme's source layout and saved as that scheme's checkpoint (config.json with its
quantization_config, safetensors), and the model's own weights replaced by their dequantized
values in fp32, so that transformers computes what the quantized checkpoint holds.

The int4 layouts are built and read back here nibble by nibble, independently of the code under
test (``weights.quant``, ``deployments.model.quant``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import write_safetensors
from weights.quantize import int4_groups, quantize_fp8, quantize_fp8_block

CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}},
          "ignore": ["lm_head"]}


def _ct(strategy: str) -> dict:
    q = json.loads(json.dumps(CT_FP8))
    q["config_groups"]["group_0"]["weights"]["strategy"] = strategy
    return q


# scheme name -> quantization_config
SCHEMES = {
    "ct-channel": _ct("channel"),
    "ct-tensor": _ct("tensor"),
    "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
    "gptq-v2": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq_v2"},
}


def pack_nibbles(x: torch.Tensor, along_rows: bool, order=range(8)) -> torch.Tensor:
    """int32 words of eight 4-bit values of x (2-D, 0..15), one value at a time."""
    x = x if along_rows else x.t()
    R, C = x.shape
    out = torch.zeros(R // 8, C, dtype=torch.int64)
    for r in range(R // 8):
        for i, j in enumerate(order):
            out[r] |= x[8 * r + j].to(torch.int64) << (4 * i)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out if along_rows else out.t().contiguous()


def unpack_nibbles(w: torch.Tensor, along_rows: bool, order=range(8)) -> torch.Tensor:
    w = (w if along_rows else w.t()).to(torch.int64) & 0xFFFFFFFF
    R, C = w.shape
    out = torch.zeros(R * 8, C, dtype=torch.int64)
    for r in range(R):
        for i, j in enumerate(order):
            out[8 * r + j] = (w[r] >> (4 * i)) & 0xF
    return out if along_rows else out.t()


AWQ = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_layer(w: torch.Tensor, scheme: str, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """(the checkpoint's tensors of one projection, by suffix; its dequantized weight [N, K] fp32)."""
    q = SCHEMES[scheme]
    if scheme in ("ct-channel", "ct-tensor", "fbgemm"):
        wq, s = quantize_fp8(w, "tensor" if scheme == "ct-tensor" else "channel")
        return {"weight": wq, "weight_scale": s}, wq.float() * (s if s.dim() == 2 else s[0])
    if scheme == "fp8-block":
        wq, s = quantize_fp8_block(w, tuple(q["weight_block_size"]))
        bn, bk = q["weight_block_size"]
        full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
        return {"weight": wq, "weight_scale_inv": s}, wq.float() * full
    G, K = q["group_size"], w.shape[1]
    if scheme == "awq":
        qi, z, s, g_idx = int4_groups(w, G, zero_point=True)
        out = {"qweight": pack_nibbles(qi, along_rows=False, order=AWQ), "qzeros": pack_nibbles(z, False, AWQ),
               "scales": s}
        deq = (unpack_nibbles(out["qweight"], False, AWQ) - unpack_nibbles(out["qzeros"], False, AWQ)
               .repeat_interleave(G, 0)[:K]).float() * s.float().repeat_interleave(G, 0)[:K]
        return out, deq.t()
    act_order = q["desc_act"]
    g_idx = torch.randperm(K, generator=gen).to(torch.int32) // G if act_order else None
    qi, z, s, g_idx = int4_groups(w, G, zero_point=not q["sym"], g_idx=g_idx)
    offset = 1 if q.get("checkpoint_format", "gptq") == "gptq" else 0
    out = {"qweight": pack_nibbles(qi, along_rows=True), "qzeros": pack_nibbles(z - offset, False), "scales": s,
           "g_idx": g_idx}
    zz = unpack_nibbles(out["qzeros"], False) + offset  # (as GPTQ's own kernels: a zero of 0 reads back as 16)
    deq = (unpack_nibbles(out["qweight"], True) - zz[g_idx.long()]).float() * s.float()[g_idx.long()]
    return out, deq.t()


def quantized_checkpoint(hf: torch.nn.Module, config: dict, scheme: str, d: Path, seed: int = 0) -> Path:
    """Save ``hf``'s weights as a ``scheme`` checkpoint in ``d`` and set its projections to the
    dequantized values (fp32): ``hf`` then computes what the checkpoint holds."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            parts = name.split(".")
            if ".layers." in name and parts[-1] == "weight" and parts[-2].endswith("_proj"):
                stored, deq = quantize_layer(p, scheme, gen)
                base = name[: -len("weight")]
                tensors.update({base + k: v for k, v in stored.items()})
                hf.get_parameter(name).copy_(deq)
            else:
                tensors[name] = p.detach().clone()
    d.mkdir(parents=True, exist_ok=True)
    write_safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": SCHEMES[scheme]}))
    return d
