"""Where a decode step's time goes: bare graph replay vs the engine's step, and the kernel mix.

    python bench/profile_decode.py --random llama-7b
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from bench.engine import load_tensors  # noqa: E402
from deployments.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from deployments.model import build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--random", default="llama-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    dev = torch.device(args.device)
    config, tensors = load_tensors(args, dev, getattr(torch, args.dtype))
    model = build_model(config, tensors)
    eng = Engine(model, None, EngineConfig(max_slots=16, max_seq_len=2048))
    eng.start()
    eng.generate([5] * 128, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    for B in (1, 16):
        g, _ = eng._graphs[(B, 512)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            g.replay()
        torch.cuda.synchronize()
        print(f"graph replay B={B} L=512: {(time.perf_counter() - t) * 10:.3f} ms")
    h = eng.submit([5] * 128, SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True))
    h.result()
    print(f"engine step B=1: {1e3 / h.decode_tokens_per_s:.3f} ms")
    eng.shutdown()
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng._decode_eager(1, 512)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
