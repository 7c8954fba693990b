"""Batch-1 decode with fused (q/k/v, gate/up) views vs separate projections, same weights.

    python bench/fused_decode.py [--out FILE]

Lays a Llama-2-7B-shaped random fp16 model out in one GPU buffer in the packer's
order (as weights.load would hand it over), builds the native model twice, once
with the fused views and once without, and times greedy decode with CUDA graphs.
Both must produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deployments.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from deployments.model import build_model  # noqa: E402
from weights.demo import SHAPES, config_dict, tensor_specs  # noqa: E402
from weights.format import align_up  # noqa: E402
from weights.packer import _layout_key  # noqa: E402


def packed_like(shape: str) -> tuple[dict, dict]:
    s = SHAPES[shape]
    specs = sorted(tensor_specs(s), key=lambda x: _layout_key(x[0]))
    sizes = [int(torch.Size(sh).numel()) * 2 for _, sh in specs]
    buf = torch.empty(sum(align_up(n) for n in sizes), dtype=torch.uint8, device="cuda")
    tensors, off = {}, 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for (name, sh), n in zip(specs, sizes):
        t = buf[off: off + n].view(torch.float16).view(sh)
        t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, 0.02, generator=g)
        tensors[name] = t
        off += align_up(n)
    cfg = config_dict(s)
    cfg["torch_dtype"] = "float16"
    return cfg, tensors


def _model(cfg: dict, tensors: dict, fused: bool):
    model = build_model(cfg, tensors)
    if not fused:
        for layer in model.model.layers:
            layer.self_attn.qkv_w = layer.self_attn.qkv_b = None
            layer.mlp.gate_up_w = layer.mlp.gate_up_b = None
    return model


def logits_rel_diff(cfg: dict, tensors: dict) -> float:
    """||fused - separate|| / ||separate|| of one forward's logits (fp16 rounding: ~1e-3)."""
    tokens = torch.arange(3, 131, device="cuda").view(1, -1)
    with torch.no_grad():
        a = _model(cfg, tensors, False)(tokens).float()
        b = _model(cfg, tensors, True)(tokens).float()
    return float((a - b).norm() / a.norm())


def decode_ms(cfg: dict, tensors: dict, fused: bool, new: int) -> tuple[float, list[int]]:
    model = _model(cfg, tensors, fused)
    eng = Engine(model, None, EngineConfig(max_slots=4, max_seq_len=1024))
    eng.start()
    try:
        p = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 35))
        eng.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        times = []
        for _ in range(3):
            h = eng.submit(prompt, p)
            ids, _, _ = h.result(timeout=300)
            times.append((h.finished_at - h.first_token_at) / (len(ids) - 1) * 1000)
        return sorted(times)[1], ids
    finally:
        eng.shutdown()
        del model
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama-7b")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()
    cfg, tensors = packed_like(a.shape)
    sep_ms, sep_ids = decode_ms(cfg, tensors, False, a.new_tokens)
    fus_ms, fus_ids = decode_ms(cfg, tensors, True, a.new_tokens)
    res = {"shape": a.shape, "separate_ms_per_token": sep_ms, "fused_ms_per_token": fus_ms,
           "same_tokens": sep_ids == fus_ids, "logits_rel_diff": logits_rel_diff(cfg, tensors),
           "command": "python bench/fused_decode.py " + " ".join(sys.argv[1:])}
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
