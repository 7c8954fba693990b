"""Quantized packs beside the fp16 one: load time, batch-1 decode and 128-concurrent throughput.

Run on the GPU machine from the repository root:

    PYTHONPATH=$PWD python bench/quant.py --work /tmp/coldstart-quant --out bench/results/quant.json
    PYTHONPATH=$PWD python bench/quant.py --formats fp8,awq --layers 8      # a quicker look

Makes (or reuses, under --work) a random checkpoint of --shape in its own dtype (row "fp16": fp16
for llama-7b) and in each of --formats
(`coldstart demo --quant FORMAT`, drawn on the GPU), packs each, and measures every pack the same
way: its load (bench/load.py's fresh-process `weights.load(device="cuda")`, page cache warm,
every checksum checked; the median of --repeats), then the engine alone (bench/engine.py's
`main` over the pack, paged cache: batch-1 decode ms per token, and total tokens/s with
--concurrency requests of --prompt-len tokens generating --new-tokens each), and the kernels each
quantized model chose (its build's self-tests: Triton weight-only, fp8 _scaled_mm). With
--quantize-fp8, the fp16 checkpoint packed with `--quantize fp8` too (its packing time beside a
plain pack's). Prints one JSON (host, GPU, commit, time, then a row per pack) and writes it to
--out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.load import run, warm_cache  # noqa: E402
from bench.meta import commit  # noqa: E402


def packs(a: argparse.Namespace) -> dict[str, Path]:
    """Each format's packed directory under --work (made once: checkpoint on the GPU, then packed)."""
    from weights import PackOptions, make_demo, pack
    work = Path(a.work)
    out: dict[str, Path] = {}
    for fmt in ["fp16", *a.formats] + (["fp16-quantize-fp8"] if a.quantize_fp8 else []):
        tag = f"{a.shape}" + (f"-{a.layers}l" if a.layers else "")
        src = work / f"{tag}-{'fp16' if fmt.startswith('fp16') else fmt}-hf"
        dest = work / f"{tag}-{fmt}"
        if not (src / "config.json").exists():
            make_demo(src, a.shape, device=a.device, layers=a.layers, force=True,
                      quant=None if fmt.startswith("fp16") else fmt)
        if not (dest / "model.cst").exists():
            t0 = time.perf_counter()
            quantize = "fp8" if fmt == "fp16-quantize-fp8" else None
            pack(src, dest, PackOptions(force=True, progress=False, quantize=quantize))
            print(f"packed {fmt} in {time.perf_counter() - t0:.1f} s", flush=True)
        out[fmt] = dest
    return out


def measure(fmt: str, dest: Path, a: argparse.Namespace) -> dict:
    """One pack's row: its file, its warm loads, the engine's figures and its kernels."""
    from bench.engine import main as engine_main
    row: dict = {"format": fmt, "file_GB": (dest / "model.cst").stat().st_size / 1e9}
    warm_cache(dest)
    loads = [run("ours", str(dest), "{}") if a.device == "cuda" else _load_here(dest) for _ in range(a.repeats)]
    row["load_s"] = statistics.median(r["seconds"] for r in loads)
    row["load_GBps"] = statistics.median(r["GBps"] for r in loads)
    c = max(a.concurrency)
    res = engine_main([str(dest), "--no-hf", "--kv-cache", "paged", "--max-slots", str(c),
                       "--concurrency", ",".join(map(str, a.concurrency)), "--prompt-len", str(a.prompt_len),
                       "--new-tokens", str(a.new_tokens), "--device", a.device, "--max-seq-len", str(a.max_seq_len)])
    row["decode_ms_per_token_b1"] = res["decode_ms_per_token_b1"]
    row["weights_GBps_b1"] = res["weights_gb_per_s_b1"]
    row.update({k: v for k, v in res.items() if k.startswith("tokens_per_s_b")})
    row["build_steps_s"] = res.get("build_steps_s", {})
    del res
    _free(a.device)  # the engine's cache and graphs, before the next load checks the free memory
    row["kernels"] = _kernels(dest, a.device)
    _free(a.device)
    return row


def _free(device: str) -> None:
    """Return what the finished runs held to the device (the loader checks the device's free memory)."""
    import gc

    import torch
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _load_here(dest: Path) -> dict:
    """A load onto the CPU in this process (bench/load.py's probes are for a GPU): the smoke test's."""
    import weights
    t0 = time.perf_counter()
    m = weights.load(dest, "cpu")
    dt = time.perf_counter() - t0
    return {"seconds": dt, "GBps": m.nbytes / dt / 1e9}


def _kernels(dest: Path, device: str) -> str:
    """What the quantized layers of ``dest`` run (the build's choice, as its log line says it)."""
    import weights
    from deployments.model import build_model
    from deployments.model.quant import QuantLinear
    m = weights.load(dest, device)
    model = build_model(m.config, m.tensors)
    layer = next((x for x in model.modules() if isinstance(x, QuantLinear)), None)
    return layer.method.kernels.describe() if layer is not None else "fp16 (cuBLAS / Triton GEMV)"


def whole_sizes(a: argparse.Namespace) -> dict:
    """Each format's pack of the whole --shape, in bytes, from packs of 1 and 2 of its layers made
    on this machine (a layer's bytes are their difference; the rest is the embeddings, the head
    and the side files): the size of a model too large to draw, such as a 70B."""
    import shutil

    from weights import PackOptions, make_demo, pack
    from weights.demo import SHAPES
    out = {}
    for fmt in ["fp16", *a.formats]:
        size = {}
        for layers in (1, 2):
            src, dest = Path(a.work) / f"size-{fmt}-{layers}-hf", Path(a.work) / f"size-{fmt}-{layers}"
            make_demo(src, a.shape, device=a.device, layers=layers, force=True, quant=None if fmt == "fp16" else fmt)
            pack(src, dest, PackOptions(force=True, progress=False))
            size[layers] = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
            shutil.rmtree(src)
            shutil.rmtree(dest)
        per_layer = size[2] - size[1]
        out[fmt] = {"per_layer_bytes": per_layer,
                    "whole_bytes": size[1] + (SHAPES[a.shape].layers - 1) * per_layer}
        print(f"{a.shape} {fmt}: {out[fmt]['whole_bytes'] / 1e9:.2f} GB packed "
              f"({per_layer / 1e9:.3f} GB a layer)", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/coldstart-quant", help="where the checkpoints and packs are kept")
    ap.add_argument("--shape", default="llama-7b", help="a `coldstart demo` shape")
    ap.add_argument("--layers", type=int, help="only this many of the shape's layers")
    ap.add_argument("--formats", type=lambda v: v.split(","), default=["fp8", "awq", "gptq"],
                    help="comma-separated `coldstart demo --quant` formats")
    ap.add_argument("--quantize-fp8", action="store_true", help="also the fp16 checkpoint packed with --quantize fp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3, help="warm loads per pack (the median is reported)")
    ap.add_argument("--concurrency", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 128))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    ap.add_argument("--sizes-only", action="store_true",
                    help="only each format's pack size of the whole --shape (whole_sizes; runs on a CPU)")
    a = ap.parse_args(argv)
    from weights.quantize import DEMO_FORMATS
    bad = [f for f in a.formats if f not in DEMO_FORMATS]
    if bad:
        ap.error(f"--formats: {', '.join(bad)} unknown; choose from {', '.join(DEMO_FORMATS)}")
    import torch
    res: dict = {"host": platform.node(), "commit": commit(),
                 "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                 "torch": torch.__version__, "shape": a.shape, "layers": a.layers, "rows": []}
    if a.sizes_only:
        res["whole_sizes"] = whole_sizes(a)
        res["command"] = "python bench/quant.py " + " ".join(argv if argv is not None else sys.argv[1:])
    else:
        for fmt, dest in packs(a).items():
            res["rows"].append(measure(fmt, dest, a))
            print(json.dumps(res["rows"][-1]), flush=True)
        base = res["rows"][0]
        for r in res["rows"][1:]:
            r["decode_speedup_vs_fp16"] = base["decode_ms_per_token_b1"] / r["decode_ms_per_token_b1"]
            r["load_speedup_vs_fp16"] = base["load_s"] / r["load_s"]
        print(json.dumps(res, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
