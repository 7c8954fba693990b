"""Time to first token of prompts of a few lengths, each twice, right after a replica-like
start (load, build, Engine.start, the default warm-up plan): shows which prefill shapes
are still slow the first time they run in the engine's loop thread (GPU machine).

    PYTHONPATH=$PWD python bench/first_prefill.py PACKED_DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.config import WarmupPlan  # noqa: E402
from deployments.engine import Engine, EngineConfig  # noqa: E402
from deployments.model import build_model  # noqa: E402
from deployments.request import SamplingParams  # noqa: E402
from deployments.server import run_warmup  # noqa: E402
from weights import load  # noqa: E402

LENGTHS = (64, 64, 128, 128, 100, 100, 64, 512, 512)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    m = load(a.packed, a.device)
    model = build_model(m.config, m.tensors)
    engine = Engine(model, None, EngineConfig(max_slots=16, max_seq_len=min(4096, model.max_position_embeddings)))
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
