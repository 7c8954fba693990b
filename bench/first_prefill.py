"""Time to first token of prompts of a few lengths, each twice, right after a replica-like
start (load, build, Engine.start, the default warm-up plan): shows which prefill shapes
are still slow the first time they run in the engine's loop thread (GPU machine).

    PYTHONPATH=$PWD python bench/first_prefill.py PACKED_DIR [--out FILE]
    PYTHONPATH=$PWD python bench/first_prefill.py PACKED_DIR --anatomy [--out FILE]

--anatomy: what a prefill length's first run costs, before any engine loop ran one:
the prefill lengths in fresh threads, one after the other (ascending, again ascending in
a new thread, descending in a third), each with the device allocations it made; then a
fourth thread's first run of one length under torch.profiler, its costliest calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import device_allocs  # noqa: E402
from deployments.config import WarmupPlan  # noqa: E402
from deployments.engine import Engine, EngineConfig  # noqa: E402
from deployments.model import build_model  # noqa: E402
from deployments.engine.request import SamplingParams  # noqa: E402
from deployments.server import run_warmup  # noqa: E402
from weights import load  # noqa: E402

LENGTHS = (64, 64, 128, 128, 100, 100, 64, 512, 512)


def _in_thread(fn) -> object:
    """Run fn() in a new thread (the first-time costs are per thread) and return its result."""
    box: list = []

    def run() -> None:
        torch.cuda.set_device(torch.cuda.current_device())
        with torch.inference_mode():
            box.append(fn())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box[0]


def anatomy(model, engine: Engine) -> dict:
    dev = model.device
    lengths = engine.prefill_lengths()

    def sweep(order: tuple[int, ...]) -> list[dict]:
        rows = []
        for n in order:
            a = device_allocs(dev)
            t = time.perf_counter()
            model.prefill(torch.zeros(1, n, dtype=torch.int64, device=dev), engine.cache, 0, 0)
            torch.cuda.synchronize(dev)
            rows.append({"tokens": n, "ms": round((time.perf_counter() - t) * 1e3, 2), "device_allocs": device_allocs(dev) - a})
        return rows

    res = {"ascending_first_thread": _in_thread(lambda: sweep(lengths)),
           "ascending_second_thread": _in_thread(lambda: sweep(lengths)),
           "descending_third_thread": _in_thread(lambda: sweep(tuple(reversed(lengths)))),
           "same_thread_again": _in_thread(lambda: sweep(lengths) and sweep(lengths))}
    from torch.profiler import ProfilerActivity, profile

    n = lengths[len(lengths) // 2]

    def profiled() -> list[dict]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.prefill(torch.zeros(1, n, dtype=torch.int64, device=dev), engine.cache, 0, 0)
            torch.cuda.synchronize(dev)
        ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
        return [{"name": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                 "cpu_total_ms": round(e.cpu_time_total / 1e3, 3)} for e in ev]
    res["profiled_tokens"] = n
    res["profile_fourth_thread"] = _in_thread(profiled)
    for k, v in res.items():
        print(k, json.dumps(v)[:3000], flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--anatomy", action="store_true", help="the first runs' costs, per thread and length")
    a = ap.parse_args(argv)
    m = load(a.packed, a.device)
    model = build_model(m.config, m.tensors)
    engine = Engine(model, None, EngineConfig(max_slots=16, max_seq_len=min(4096, model.max_position_embeddings)))
    if a.anatomy:
        res = {"command": "PYTHONPATH=$PWD python bench/first_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
               **anatomy(model, engine)}
        if a.out:
            a.out.write_text(json.dumps(res, indent=2))
        return res
    engine.start()
    run_warmup(engine, WarmupPlan(), list(range(3, 40)))
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in LENGTHS:
        h = engine.submit(torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist(),
                          SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        h.result(timeout=600)
        rows.append({"prompt_tokens": n, "ttft_ms": round(h.ttft_s * 1e3, 1)})
        print(n, rows[-1]["ttft_ms"], flush=True)
    engine.shutdown()
    res = {"command": "PYTHONPATH=$PWD python bench/first_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "requests": rows}
    if a.out:
        a.out.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
