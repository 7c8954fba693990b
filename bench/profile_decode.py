"""Where a decode step's time goes (GPU machine): floors, graph replay, engine step, kernel mix.

    python bench/profile_decode.py --random llama-7b --out bench/results/runs/decode-profile.json
    python bench/profile_decode.py /tmp/coldstart-bench/packed --out ...    # a packed model

Measures, in one process:
  copy_GBps          device-to-device copy of 2 GiB: the bandwidth roofline
  gemv_floor_ms      one CUDA graph holding only the step's matrix-vector products
                     (every layer's projections and lm_head at batch 1): the
                     time left if every other kernel cost nothing
  gemv_GBps          each projection shape alone, weights read per second
  replay_ms          graph replay of the full decode step per (batch, kv length)
  engine_ms_b1       the engine's step at batch 1 (replay + sampling + streaming)
  capture_s          engine start: first launches (Triton compiles, unless cached) + capture
  kernels            the eager step's kernels, grouped by name, with counts and time
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.engine import load_tensors  # noqa: E402
from deployments import kernels  # noqa: E402
from deployments.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from deployments.model import build_model  # noqa: E402


def _time_graph(fn, reps: int = 50) -> float:
    """Capture fn once as a graph and return the mean replay time in ms."""
    g = kernels.capture_graph(fn, "cuda")
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / reps


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    ms = _time_graph(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() * 2 / (ms / 1e3) / 1e9  # read + write


def gemv(model) -> tuple[float, dict]:
    layers = model.model.layers
    x = torch.randn(1, 1, model.config.hidden_size, device="cuda", dtype=model.dtype)
    xf = torch.randn(1, 1, model.config.intermediate_size, device="cuda", dtype=model.dtype)
    mats = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        mats += [(a.qkv_w if a.qkv_w is not None else a.q_proj.weight, x), (a.o_proj.weight, x),
                 (m.gate_up_w if m.gate_up_w is not None else m.gate_proj.weight, x), (m.down_proj.weight, xf)]
    mats.append((model.lm_head.weight, x))

    def all_gemv():
        for w, inp in mats:
            F.linear(inp, w)

    floor = _time_graph(all_gemv, reps=20)
    per_shape = {}
    for w, inp in mats[:4] + mats[-1:]:
        reps = 32
        ms = _time_graph(lambda: [F.linear(inp, w) for _ in range(reps)], reps=10) / reps
        per_shape["x".join(map(str, w.shape))] = round(w.numel() * w.element_size() / (ms / 1e3) / 1e9, 1)
    return floor, per_shape


def triton_probe() -> dict:
    out = {}
    t = time.perf_counter()
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - report, don't fail
        return {"error": repr(e)}
    out["import_s"] = round(time.perf_counter() - t, 3)
    out["version"] = triton.__version__

    @triton.jit
    def _add1(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(1000, device="cuda")
    t = time.perf_counter()
    _add1[(4,)](x, 1000, BLOCK=256)
    torch.cuda.synchronize()
    out["first_compile_s"] = round(time.perf_counter() - t, 3)
    return out


def kernel_table(eng: Engine, B: int, L: int) -> list[dict]:
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng._decode_eager(B, L)
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" and getattr(e, "self_device_time_total", 0) == 0:
            continue
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us <= 0:
            continue
        agg[e.key][0] += e.count
        agg[e.key][1] += us
    rows = [{"kernel": k[:90], "per_step": c / 3, "us_per_step": round(us / 3, 1)} for k, (c, us) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", help="packed directory or HF safetensors directory")
    ap.add_argument("--random", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.model and not args.random:
        args.random = "llama-7b"
    dev = torch.device(args.device)
    res: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    res["triton"] = triton_probe()
    res["copy_GBps"] = round(copy_bandwidth(), 1)
    config, tensors = load_tensors(args, dev, getattr(torch, args.dtype))
    model = build_model(config, tensors)
    res["weight_GB"] = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    res["gemv_floor_ms"], res["gemv_GBps"] = gemv(model)
    eng = Engine(model, None, EngineConfig(max_slots=16, max_seq_len=2048))
    eng.start()  # the first launch of each Triton kernel compiles it (or takes it from the cache)
    res["capture_s"] = round(eng.stats()["capture_s"], 3)
    res["kernels"] = ("triton" + ("+attention" if model.use_attention_kernel else "")
                      + (f"+gemv({len(model.gemv_shapes)} shapes)" if model.gemv_shapes else "")
                      if model.use_kernels else "torch")
    res["triton_cache_dir"] = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
    eng.generate([5] * 128, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    res["replay_ms"] = {}
    for B in (1, 4, 16):
        for L in (512, 2048):
            if (B, L) not in eng._graphs:
                continue
            g, _ = eng._graphs[(B, L)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(100):
                g.replay()
            torch.cuda.synchronize()
            res["replay_ms"][f"B{B}_L{L}"] = round((time.perf_counter() - t) * 10, 3)
    h = eng.submit([5] * 128, SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True))
    h.result()
    res["engine_ms_b1"] = round(1e3 / h.decode_tokens_per_s, 3)
    eng.shutdown()
    res["kernels_B1_L512"] = kernel_table(eng, 1, 512)
    res["kernels_per_step"] = sum(r["per_step"] for r in res["kernels_B1_L512"])
    res["command"] = "python " + " ".join(sys.argv)
    print(json.dumps({k: v for k, v in res.items() if k != "kernels_B1_L512"}, indent=1))
    for r in res["kernels_B1_L512"][:25]:
        print(f"{r['us_per_step']:9.1f} us  x{r['per_step']:5.0f}  {r['kernel']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
