"""Where a batched prefill's device time goes: the model's ``prefill_batch`` of ``--rows`` fresh
prompts of ``--prompt-len`` tokens into a paged cache (the engine's shared prefill at
serve_config.gpu.yaml's 2048-token chunk: 16 prompts of 128), its wall time per forward and its
kernels' device time under torch's profiler, the largest first, with the rate of the matrix products.

    python bench/prefill_kernels.py /tmp/coldstart-bench/packed --out OUT/prefill-kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.meta import stamp  # noqa: E402
from deployments.model import build_model  # noqa: E402

# cuBLAS' kernels' names hold one of these (on the CPU: the operators')
GEMM = ("gemm", "nvjet", "cutlass", "xmma", "sm90", "aten::addmm", "aten::mm")


def kernel_rows(prof, runs: int, cuda: bool) -> list[dict]:
    """A torch profiler's kernels (on the CPU: operators) by their own device time per run, largest first."""
    rows = []
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": e.key[:110], "ms": us / runs / 1e3, "calls": e.count // runs})
    rows.sort(key=lambda r: -r["ms"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a packed model directory")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda", help="cpu: the script's own check (its operators' CPU time)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import weights

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    loaded = weights.load(Path(a.model), dev)
    model = build_model(loaded.config, loaded.tensors)
    model.setup_rope(4096)
    per_seq = -(-a.prompt_len // a.block_size)
    cache = model.new_paged_cache(1 + a.rows * per_seq, a.block_size, a.rows, per_seq * a.block_size)
    for s in range(a.rows):
        cache.assign(s, list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)))
    tokens = torch.randint(3, model.config.vocab_size, (a.rows, a.prompt_len), device=dev)
    slots, valid = list(range(a.rows)), [a.prompt_len] * a.rows

    def forward() -> None:
        model.prefill_batch(tokens, cache, slots, valid, logit_rows=a.rows)

    with torch.inference_mode():
        for _ in range(3):
            forward()
        sync()
        t = time.perf_counter()
        for _ in range(10):
            forward()
        sync()
        wall_ms = (time.perf_counter() - t) / 10 * 1e3
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                forward()
            sync()
    rows = kernel_rows(prof, 3, cuda)
    device_ms = sum(r["ms"] for r in rows)
    gemm_ms = sum(r["ms"] for r in rows if any(g in r["kernel"].lower() for g in GEMM))
    c = model.config
    n_tok = a.rows * a.prompt_len
    per_layer = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim \
        + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    flops = 2 * n_tok * per_layer * c.num_hidden_layers
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "rows": a.rows,
           "prompt_len": a.prompt_len, "wall_ms": wall_ms, "device_ms": device_ms, "gemm_ms": gemm_ms,
           "gemm_tflops": flops / gemm_ms / 1e9 if gemm_ms else None, "layers_tflops_over_wall": flops / wall_ms / 1e9,
           "kernels": rows, "command": "python bench/prefill_kernels.py " + " ".join(sys.argv[1:])}
    print(f"prefill {a.rows}x{a.prompt_len}: wall {wall_ms:.2f} ms a forward, device {device_ms:.2f} ms, of it the "
          f"projections {gemm_ms:.2f} ms ({res['gemm_tflops'] or 0:.0f} TFLOP/s); the layers' products over the wall "
          f"{res['layers_tflops_over_wall']:.0f} TFLOP/s")
    for r in rows[: a.top]:
        print(f"  {r['ms']:8.3f} ms {r['calls']:5d}x  {r['kernel']}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(stamp(res), indent=1))


if __name__ == "__main__":
    main()
