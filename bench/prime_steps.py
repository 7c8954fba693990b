"""What deployments.prime's steps cost in a fresh process (GPU machine).

Imports torch, makes the CUDA context, then runs ``deployments.prime.run`` for a model's
config.json (each step synchronized and timed) under torch.profiler, and writes the steps
and the calls with the most own time; then runs it again (what is left once everything is
loaded).

    PYTHONPATH=$PWD python bench/prime_steps.py PACKED_OR_HF_DIR --out prime-steps.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a directory with the model's config.json")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-profiler", action="store_true", help="time the steps only")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    from bench.start_profile import torch_profiled
    from deployments.startup import prime
    res: dict = {"command": "PYTHONPATH=$PWD python bench/prime_steps.py " + " ".join(sys.argv[1:] if argv is None else argv),
                 "imports_s": round(time.perf_counter() - t0, 3)}
    t = time.perf_counter()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    res["context_s"] = round(time.perf_counter() - t, 3)
    config = json.loads((a.model / "config.json").read_text())
    dtype = getattr(torch, a.dtype)
    first: dict = {}
    if a.no_profiler:
        res["first_s"] = round(prime.run(config, "cuda", dtype, first), 3)
    else:
        res.update(torch_profiled(lambda: res.__setitem__("first_s", round(prime.run(config, "cuda", dtype, first), 3)),
                                  a.top))
    again: dict = {}
    res["again_s"] = round(prime.run(config, "cuda", dtype, again), 3)
    res["first_steps_s"], res["again_steps_s"] = first, again
    print(json.dumps({k: res[k] for k in ("imports_s", "context_s", "first_s", "again_s", "first_steps_s", "again_steps_s")}))
    for row in res.get("top_own_calls", [])[:25]:
        print(f"{row['own_ms']:9.2f} ms own  {row['calls']:6d}  {row['name']}")
    if a.out:
        a.out.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
