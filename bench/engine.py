"""Benchmark the native engine against transformers' eager `generate`.

Usage (GPU machine):
    python bench/engine.py weights/llama-7b --out bench/work/engine.json
    python bench/engine.py /path/to/hf-checkpoint --out ...      # safetensors directory
    python bench/engine.py --random llama-7b --out ...            # random fp16 weights made on the GPU
    python bench/engine.py /tmp/tiny-hf --device cpu --dtype float32 --new-tokens 16 --out /tmp/b.json

Measures: import time of the engine modules (subprocess, torch already imported),
graph capture + warm-up (the replica's default plan, deployments.engine.warmup.WarmupPlan), first request after warm-up vs the tenth, batch-1
decode ms/token (and the GB/s of weights it implies), total tokens/s at 1, 4
and 16 concurrent requests, and HF eager `generate` ms/token on the same tensors.
Every timing syncs the device first.

Beside each load, its bound (bench/bound.py): the bytes its decode steps must read (weights and
the KV cache they attend to) over the device's copy bandwidth plus its prefills' FLOPs over the
device's matmul rate, both ceilings measured once at the start of the run; and the engine's share
of it (bound time / measured time).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bound import Dims, decode_step_bound_s, load_bound, measure_ceilings  # noqa: E402
from bench.meta import stamp  # noqa: E402
from deployments.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from deployments.engine.warmup import WarmupPlan, run_warmup  # noqa: E402
from deployments.model import build_model  # noqa: E402
from weights.demo import SHAPES, config_dict  # noqa: E402
from weights.tp import layout, rank_config, shard_shape  # noqa: E402

RANDOM_CONFIGS = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024),
    # the grouped-query subject and the tensor-parallel ones, as `coldstart demo` makes them
    **{name: config_dict(SHAPES[name]) for name in ("llama3-8b", "llama2-13b", "llama3-70b")},
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_tensors(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """(config dict, tensors dict): the boundary the project loader (`weights.load`) also returns."""
    if args.random:
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **RANDOM_CONFIGS[args.random]}
        if args.layers:
            cfg["num_hidden_layers"] = args.layers
        hd = cfg["hidden_size"] // cfg["num_attention_heads"]
        shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"]),
                  "model.norm.weight": (cfg["hidden_size"],),
                  "lm_head.weight": (cfg["vocab_size"], cfg["hidden_size"])}
        D, F, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * hd
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            shapes |= {p + "self_attn.q_proj.weight": (D, D), p + "self_attn.k_proj.weight": (kv, D),
                       p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, D),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,)}
        if args.tp_rank:  # one rank's part (the same sizes on every rank): a one-device model of them
            lay = layout(cfg, args.tp_rank)
            shapes = {k: shard_shape(k, v, lay) for k, v in shapes.items()}
            cfg = rank_config(cfg, args.tp_rank)
        # one buffer in the packer's order, as the loader gives a packed model's: q/k/v and
        # gate/up back to back, so the build fuses them (separate tensors take the unfused path)
        g = torch.Generator(device=device).manual_seed(0)
        flat = torch.empty(sum(math.prod(s) for s in shapes.values()), device=device, dtype=dtype)
        tensors, at = {}, 0
        for k, s in shapes.items():
            t = tensors[k] = flat[at: at + math.prod(s)].view(s)
            at += t.numel()
            if len(s) == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)
        return cfg, tensors
    d = Path(args.model)
    if (d / "model.cst").exists():  # packed directory: the project loader
        import weights

        loaded = weights.load(d, device)
        return loaded.config, loaded.tensors
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{d}: no model.cst and no *.safetensors; give a packed or HF checkpoint directory")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f), device=str(device)))
    tensors = {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in tensors.items()}
    return json.loads((d / "config.json").read_text()), tensors


def device_allocs(device: torch.device) -> int:
    """The caching allocator's calls into the driver so far (0 off the GPU)."""
    if device.type != "cuda":
        return 0
    st = torch.cuda.memory_stats(device)
    return st.get("num_device_alloc", st.get("segment.all.allocated", 0))


def import_seconds() -> float:
    code = ("import torch, time; t = time.perf_counter();"
            "import deployments.model, deployments.engine.engine, deployments.engine.tokenizer;"
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


# a run's work (bench/throughput.py reads them too)
WORK = ("steps", "batched_prefills", "busy_s", "prefill_s", "decode_s", "prompt_tokens")


def run_concurrent(engine: Engine, prompts: list[list[int]], new_tokens: int, device: torch.device,
                   work: dict | None = None) -> float:
    """Total generated tokens/s with all prompts submitted at once (prefill included); ``work``
    gets the engine's steps, shared prefills and busy time in the run, and its wall seconds."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    sync(device)
    before = engine.stats()
    t0 = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    results = [h.result(timeout=600) for h in handles]
    wall = time.perf_counter() - t0
    n = sum(len(ids) for ids, _, _ in results)
    failed = [h.error for h, (_, _, reason) in zip(handles, results) if reason != "length"]
    if failed:  # a figure with requests that did not run to their length measures nothing
        raise RuntimeError(f"{len(failed)} of {len(handles)} requests did not finish with their length: {failed[:3]}")
    time.sleep(0.05)  # (the loop's last turn ends after the last request's)
    if work is not None:
        after = engine.stats()
        work.update({k: after[k] - before[k] for k in WORK}, wall_s=wall)
    return n / wall


def profile_steps(engine: Engine, prompts: list[list[int]], others: list[list[int]], new_tokens: int,
                  device: torch.device) -> dict:
    """One concurrent run of ``prompts`` with the decode step's launch wrapped in CUDA events
    (device time per step against wall time per step: the rest is the host's, unless the two
    overlap), then one of ``others`` (new prompts: none found in a paged cache's prefix reuse)
    under cProfile in the loop thread (the profiler slows the host: read its shares, not its
    times)."""
    import cProfile
    import io
    import pstats
    import threading

    runner = engine.runner
    events: dict[str, list] = {"decode": [], "prefill": [], "prefill_group": []}
    originals = {name: getattr(runner, name) for name in events}

    def timed(name: str):
        fn = originals[name]

        def call(*a, **kw):
            if device.type != "cuda":
                return fn(*a, **kw)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = fn(*a, **kw)
            e1.record()
            events[name].append((e0, e1))
            return out
        return call

    for name in events:
        setattr(runner, name, timed(name))
    work: dict = {}
    tps = run_concurrent(engine, prompts, new_tokens, device, work)
    wall, steps = work["wall_s"], work["steps"]
    for name, fn in originals.items():
        setattr(runner, name, fn)
    sync(device)
    ms = {name: sum(a.elapsed_time(b) for a, b in ev) for name, ev in events.items()}
    cuda = device.type == "cuda"
    prefills = len(events["prefill"]) + len(events["prefill_group"])
    res = {"concurrency": len(prompts), "tokens_per_s": tps, "wall_s": wall, "decode_steps": steps,
           "wall_ms_per_step": wall * 1e3 / max(steps, 1),
           "decode_device_ms_per_step": ms["decode"] / max(len(events["decode"]), 1) if cuda else None,
           "decode_device_share": ms["decode"] / 1e3 / wall if cuda else None,
           # the prefill forwards (one prompt's chunk, or a group of fresh prompts): how many, and their share
           "prefill_forwards": prefills if cuda else None,
           "prefill_device_share": (ms["prefill"] + ms["prefill_group"]) / 1e3 / wall if cuda else None}

    # the loop thread runs already: its profiler is switched on and off from inside its steps
    prof, target = cProfile.Profile(), engine._thread.ident
    started = threading.Event()
    run_prefill = engine.executor.run_prefill  # (the loop calls it first in each busy turn)

    def profile_from_here(*a, **kw):
        if not started.is_set() and threading.get_ident() == target:
            started.set()
            prof.enable()
        return run_prefill(*a, **kw)

    engine.executor.run_prefill = profile_from_here
    run_concurrent(engine, others, new_tokens, device)
    engine.executor.run_prefill = run_prefill
    done = threading.Event()

    def stop(*a, **kw):
        if threading.get_ident() == target and not done.is_set():
            prof.disable()
            done.set()
        return run_prefill(*a, **kw)

    engine.executor.run_prefill = stop
    run_concurrent(engine, prompts[:1], 2, device)
    engine.executor.run_prefill = run_prefill
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    res["cprofile_tottime"] = buf.getvalue().splitlines()
    # the kernels of one more run of ``others``, by their device time per decode step (all of the
    # run's kernels, its prefills' too, over its decode steps)
    from torch.profiler import ProfilerActivity, profile

    from bench.prefill_kernels import kernel_rows
    before = engine.stats()["steps"]
    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as kp:
        run_concurrent(engine, others, new_tokens, device)
        sync(device)
    steps = max(engine.stats()["steps"] - before, 1)
    res["kernels_per_step"] = kernel_rows(kp, steps, device.type == "cuda")[:25]
    for k, v in res.items():
        if k not in ("cprofile_tottime", "kernels_per_step"):
            print(f"profile {k} {v:.3f}" if isinstance(v, float) else f"profile {k} {v}")
    print("\n".join(res["cprofile_tottime"][:45]))
    for r in res["kernels_per_step"][:20]:
        print(f"kernel {r['ms']:8.3f} ms {r['calls']:5d}x  {r['kernel']}")
    return res


def hf_ms_per_token(config: dict, tensors: dict, prompt: list[int], new_tokens: int, device: torch.device) -> float:
    """transformers eager generate on the same tensors: (t(N) - t(1)) / (N - 1)."""
    from deployments.model.hf_fallback import build_hf_model

    hf = build_hf_model(config, tensors, reference=True).hf
    ids = torch.tensor([prompt], device=device)

    def gen(n: int) -> float:
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t

    gen(2)  # warm-up
    return (gen(new_tokens) - gen(1)) / (new_tokens - 1) * 1e3


def bound_of_load(res: dict, dims: Dims, weight_bytes: int, kv_itemsize: int, prompts: list[list[int]],
                  new_tokens: int, work: dict) -> dict:
    """The bound of one concurrent run and the engine's share of it (prompt positions the engine
    did not prefill, found in its prefix cache, count as a prefix of each prompt)."""
    ceil, lens = res["ceilings"], [len(p) for p in prompts]
    cached = max(0, sum(lens) - work["prompt_tokens"]) // len(prompts)
    b = load_bound(dims, weight_bytes, kv_itemsize, lens, new_tokens, ceil["copy_bytes_per_s"], ceil["flops_per_s"],
                   cached=cached)
    return {"tokens_per_s": len(prompts) * new_tokens / b.seconds, "seconds": b.seconds, "prefill_s": b.prefill_s,
            "decode_s": b.decode_s, "decode_gb": b.decode_bytes / 1e9, "prefill_tflop": b.prefill_flops / 1e12,
            "engine_share": b.seconds / work["wall_s"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="packed directory or HF safetensors directory")
    ap.add_argument("--random", choices=sorted(RANDOM_CONFIGS), help="random weights of this shape instead")
    ap.add_argument("--layers", type=int, help="with --random: this many of the shape's layers")
    ap.add_argument("--tp-rank", type=int, metavar="N",
                    help="with --random: one rank's part of the model split over N (its decode step, without "
                         "the ranks' all-reduce: what a tensor-parallel step costs less its collectives)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out", type=Path, help="write the JSON results here")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prompt-lens", type=lambda v: tuple(int(x) for x in v.split(",")), metavar="LO,HI",
                    help="the concurrent runs' prompts of lengths drawn from LO..HI instead (a mixed load)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=512, help="engine.prefill_chunk")
    ap.add_argument("--reserve-gib", type=float, default=None,
                    help="engine.reserve_bytes, in GiB (default: the engine's, from the model and the prefill chunk)")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--kv-cache", choices=["static", "paged"], default="static", help="engine.kv_cache")
    ap.add_argument("--kv-block-size", type=int, default=16, help="engine.kv_block_size (paged)")
    ap.add_argument("--no-prefix-cache", action="store_true", help="engine.prefix_cache off (paged)")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every prompt begins with the same N tokens (a system prompt) before its own --prompt-len")
    ap.add_argument("--new-prefix", action="store_true",
                    help="with --shared-prefix: each concurrent run's prompts share a prefix of their own, not in "
                         "the cache yet (a burst behind a new system prompt), instead of the warm-up's")
    ap.add_argument("--concurrency", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 4, 16),
                    help="concurrent requests to time total tokens/s at, e.g. 1,16,64,128 (up to --max-slots)")
    ap.add_argument("--graph-batch-sizes", type=lambda v: tuple(int(x) for x in v.split(",")),
                    help="decode batch buckets, e.g. 1,4,16 (default: the engine's)")
    ap.add_argument("--kv-buckets", type=lambda v: tuple(int(x) for x in v.split(",")),
                    help="decode key-length buckets, e.g. 512,4096 (default: the engine's)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--profile", action="store_true",
                    help="at the largest concurrency, where a step's time goes: the decode steps' device time "
                         "(CUDA events) against their wall time, and the loop thread's busiest functions (cProfile)")
    ap.add_argument("--start-only", action="store_true",
                    help="only the start: load + build, capture, one warm-up request (one JSON line)")
    args = ap.parse_args(argv)
    if not args.model and not args.random:
        ap.error("give a model directory or --random SHAPE")
    if args.prompt_lens and (len(args.prompt_lens) != 2 or not 1 <= args.prompt_lens[0] <= args.prompt_lens[1]):
        ap.error(f"--prompt-lens {args.prompt_lens}: want LO,HI with 1 <= LO <= HI")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "dtype": args.dtype, "torch": torch.__version__,
                 **({"random": args.random, "layers": args.layers, "tp_rank": args.tp_rank} if args.random else {})}

    res["import_s"] = import_seconds()
    res["ceilings"] = measure_ceilings(device, dtype)  # once, before the weights take the memory
    print(f"ceilings: copy {res['ceilings']['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"matmul {res['ceilings']['flops_per_s'] / 1e12:.1f} TFLOP/s ({args.dtype})", flush=True)
    sync(device)
    t = time.perf_counter()
    config, tensors = load_tensors(args, device, dtype)
    model = build_model(config, tensors)
    sync(device)
    res["load_build_s"] = time.perf_counter() - t
    res["build_steps_s"] = dict(getattr(model, "build_s", {}))  # assemble, kernel tests, GEMV choice
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    res["weight_gb"] = weight_bytes / 1e9
    dims, kv_itemsize = Dims.of(config), model.dtype.itemsize

    max_seq = min(args.max_seq_len, model.max_position_embeddings)
    ecfg = EngineConfig(max_slots=args.max_slots, max_seq_len=max_seq, cuda_graphs=not args.no_graphs,
                        prefill_chunk=args.prefill_chunk,
                        reserve_bytes=None if args.reserve_gib is None else int(args.reserve_gib * 2**30),
                        kv_cache=args.kv_cache, kv_block_size=args.kv_block_size,
                        prefix_cache=not args.no_prefix_cache,
                        graph_batch_sizes=args.graph_batch_sizes, kv_len_buckets=args.kv_buckets)
    engine = Engine(model, None, ecfg)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    shared = torch.randint(3, vocab, (args.shared_prefix,), generator=gen).tolist()

    def prompt(mixed: bool = False, prefix: list[int] | None = None) -> list[int]:
        n = args.prompt_len
        if mixed and args.prompt_lens:  # a mixed load: each prompt's own length drawn between the two
            lo, hi = args.prompt_lens
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return (shared if prefix is None else prefix) + torch.randint(3, vocab, (n,), generator=gen).tolist()

    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    sync(device)
    t = time.perf_counter()
    engine.start()  # CUDA-graph capture
    res["capture_s"] = engine.stats()["capture_s"]
    run_warmup(engine, WarmupPlan(), prompt())  # the replica's default warm-up plan
    sync(device)
    res["capture_warmup_s"] = time.perf_counter() - t
    if args.start_only:
        # the warm-up plan again, twice: the first time paid the lazy set-up, this is the work
        plan = []
        for _ in range(2):
            t = time.perf_counter()
            run_warmup(engine, WarmupPlan(), prompt())
            sync(device)
            plan.append(round(time.perf_counter() - t, 3))
        st = engine.stats()
        engine.shutdown()
        env = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_MODULE_LOADING", "OMP_NUM_THREADS",
                                              "TRITON_CACHE_DIR")}
        print("START " + json.dumps({"env": env, "load_build_s": round(res["load_build_s"], 3),
                                     "first_launch_s": round(st["first_launch_s"], 3),
                                     "capture_s": round(st["capture_s"], 3),
                                     "capture_warmup_s": round(res["capture_warmup_s"], 3),
                                     "plan_warmup_s": plan,
                                     "graphs": st["graphs"],
                                     "build_steps_s": {k: round(v, 3) for k, v in res.get("build_steps_s", {}).items()},
                                     "first_launch_ms": st.get("first_launch_ms"),
                                     "first_prefill_ms": st.get("first_prefill_ms")}), flush=True)
        return res

    engine.capture_deferred()  # as the replica does once warm: measured once every graph is there
    deadline = time.time() + 300
    while engine.stats()["graphs_deferred"] and engine.alive() and time.time() < deadline:
        time.sleep(0.01)
    if not engine.alive():  # (a late capture that failed: every later number would be meaningless)
        raise RuntimeError(f"the engine's loop died while capturing its graphs: {engine.error!r}") from engine.error
    res["late_captures"] = engine.stats()["late_captures"]  # batch size: [ms, why]
    times, ttfts, decodes, queues, allocs = [], [], [], [], []
    for _ in range(10):
        a = device_allocs(device)
        t = time.perf_counter()
        h = engine.submit(prompt(), SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        _, _, reason = h.result(timeout=600)
        if reason not in ("length", "stop"):
            raise RuntimeError(f"a timed request ended with {reason!r}: {h.error or engine.error!r}")
        times.append((time.perf_counter() - t) * 1e3)
        ttfts.append(h.ttft_s * 1e3)  # queue + prefill + first token
        queues.append(h.queue_wait_s * 1e3)  # submit -> a cache slot: the loop's wake-up
        decodes.append(15 / h.decode_tokens_per_s * 1e3 if h.decode_tokens_per_s else None)  # the other 15
        allocs.append(device_allocs(device) - a)  # > 0: this request grew the allocator's pool
    res["request_ms"] = times  # all ten: one pair alone is at the mercy of a shared host
    res["request_ttft_ms"], res["request_decode_ms"] = ttfts, decodes  # where a slow request spent it
    res["request_queue_ms"], res["request_device_allocs"] = queues, allocs
    res["first_request_ms"], res["tenth_request_ms"] = times[0], times[9]
    res["later_requests_median_ms"] = sorted(times[1:])[len(times[1:]) // 2]
    res["first_vs_tenth_ms"] = [times[0], times[9]]

    p1 = prompt()
    h = engine.submit(p1, greedy)
    h.result(timeout=600)
    res["ttft_ms_b1"] = h.ttft_s * 1e3
    res["decode_ms_per_token_b1"] = 1e3 / h.decode_tokens_per_s
    res["weights_gb_per_s_b1"] = res["weight_gb"] / (res["decode_ms_per_token_b1"] / 1e3)
    # a batch-1 step's bound at its middle position: the weights and the keys so far
    res["bound_decode_ms_per_token_b1"] = 1e3 * decode_step_bound_s(
        dims, weight_bytes, kv_itemsize, len(p1) + args.new_tokens // 2, res["ceilings"]["copy_bytes_per_s"])
    res["engine_share_decode_b1"] = res["bound_decode_ms_per_token_b1"] / res["decode_ms_per_token_b1"]
    print(f"bound b1 decode: {res['bound_decode_ms_per_token_b1']:.3f} ms/token, measured "
          f"{res['decode_ms_per_token_b1']:.3f}: share {res['engine_share_decode_b1']:.2f}", flush=True)

    for c in args.concurrency:
        if c > args.max_slots:
            continue
        # --new-prefix: a system prompt the cache has not seen, shared by this run's prompts alone
        fresh = torch.randint(3, vocab, (args.shared_prefix,), generator=gen).tolist() if args.new_prefix else None
        work: dict = {}
        prompts = [prompt(True, fresh) for _ in range(c)]
        res[f"tokens_per_s_b{c}"] = run_concurrent(engine, prompts, args.new_tokens, device, work)
        res[f"work_b{c}"] = work
        b = res[f"bound_b{c}"] = bound_of_load(res, dims, weight_bytes, kv_itemsize, prompts, args.new_tokens, work)
        print(f"bound b{c}: {b['tokens_per_s']:.1f} tokens/s (prefill {b['prefill_s'] * 1e3:.1f} ms + decode "
              f"{b['decode_s'] * 1e3:.1f} ms), measured {res[f'tokens_per_s_b{c}']:.1f}: share "
              f"{b['engine_share']:.2f}", flush=True)
    if args.profile:
        c = max(c for c in args.concurrency if c <= args.max_slots)
        res["profile"] = profile_steps(engine, [prompt() for _ in range(c)], [prompt() for _ in range(c)],
                                       args.new_tokens, device)
    if "tokens_per_s_b16" in res and "tokens_per_s_b1" in res:
        res["ratio_b16_b1"] = res["tokens_per_s_b16"] / res["tokens_per_s_b1"]
    res["engine_stats"] = engine.stats()  # (paged: kv_blocks, the cache's size in blocks)
    for k in ("reserve_bytes", "prefill_peak_bytes", "prefill_peak_reserved_bytes"):  # the reserve against its use
        if k in res["engine_stats"]:
            res[k.replace("_bytes", "_gib")] = res["engine_stats"][k] / 2**30
    if "preemptions" in res["engine_stats"]:
        res["preemptions"] = res["engine_stats"]["preemptions"]
    res["kv_cache"], res["shared_prefix"], res["prompt_lens"] = args.kv_cache, args.shared_prefix, args.prompt_lens
    res["prompt_len"], res["new_tokens"] = args.prompt_len, args.new_tokens
    engine.shutdown()
    del engine

    if not args.no_hf:
        res["hf_ms_per_token"] = hf_ms_per_token(config, tensors, prompt(), min(args.new_tokens, 64), device)
        res["speedup_vs_hf_b1"] = res["hf_ms_per_token"] / res["decode_ms_per_token_b1"]

    rows = [(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in res.items()
            if k not in ("engine_stats", "profile", "ceilings") and not k.startswith("bound_b")]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        res["command"] = "python bench/engine.py " + " ".join(sys.argv[1:])
        args.out.write_text(json.dumps(stamp(res), indent=2))
    return res


if __name__ == "__main__":
    main()
