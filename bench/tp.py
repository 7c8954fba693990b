"""Tensor parallelism's figures: a rank's load on one GPU, and a tensor-parallel replica on several.

Run on the GPU machine from the repository root:

    PYTHONPATH=$PWD python bench/tp.py rank-load --out OUT [--layers 20]
    PYTHONPATH=$PWD python bench/tp.py serve --out OUT --shape llama3-70b --tp 4 [--layers 80]
    PYTHONPATH=$PWD python bench/tp.py channel --out OUT

rank-load (one GPU): a Llama-3-70B-shaped pack split over 4 ranks, written directly on the GPU
(`coldstart demo --shape llama3-70b --tp 4 --layers L`; all four ranks of the 80 layers are
141 GB, so L fits the disk), and rank 0's file loaded the way a rank loads it
(`weights.load(DEST/rank-0)`, every checksum checked), in a fresh process each time:
`--repeats` times from a warm page cache, and `--cold-pairs` times from a dropped one, each right
after the disk's own rate read from the same file (bench/load.py's probes; the shared disk's
rate drifts). The decode step of a whole rank is `bench/engine.py --random llama3-70b --tp-rank 4`.

serve (N GPUs): the split pack's replica deployed with the options `deployments.app.build_app`
gives `tp` N (N bundles of a GPU each, STRICT_PACK) and serve_config.yaml's warm-up, timed from the controller adding
the replica to RUNNING as bench/serve.py times every replica (`--repeat` rounds, page cache warm);
its ranks' start phases from /stats; then batch-1 decode through HTTP, ms per token after the
first (128 greedy tokens; the replica's x-coldstart-ttft-s header splits off the first).

channel (CPU; no GPU needed): what lockstep costs a tensor-parallel decode step. Rank 0's runner
calls reach the other ranks over a gloo group on the node's loopback (deployments.engine.mirror);
this sends `--calls` decode calls of B rows each (as the engine sends them) from rank 0 to 1 and
to 3 other processes, and times them to the last rank's receipt: microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.load import cold_pairs, drop_caches, run, warm_cache  # noqa: E402
from bench.meta import stamp  # noqa: E402


def split_pack(work: Path, shape: str, tp: int, layers: int | None, device: str = "cuda") -> tuple[Path, dict]:
    """The random split pack under ``work`` (made on the GPU once) and how long making it took."""
    from weights import make_demo
    dest = work / (f"{shape}-tp{tp}" + (f"-{layers}l" if layers else ""))
    prep: dict = {}
    if not (dest / "tp.json").exists():
        t0 = time.perf_counter()
        make_demo(dest, shape, device=device, tp=tp, layers=layers, force=True)
        prep["demo_s"] = time.perf_counter() - t0
    return dest, prep


def rank_load(a: argparse.Namespace) -> dict:
    dest, prep = split_pack(Path(a.work), "llama3-70b", 4, a.layers)
    rank0 = dest / "rank-0"
    res: dict = {"pack": str(dest), "prep": prep, "rank_file_GB": (rank0 / "model.cst").stat().st_size / 1e9}
    print(f"rank 0 of {dest}: {res['rank_file_GB']:.1f} GB", flush=True)
    warm_cache(rank0)
    res["warm"] = [run("ours", str(rank0), "{}") for _ in range(a.repeats)]
    res["cold_pairs"] = cold_pairs(rank0, a.cold_pairs)
    res["summary"] = {
        "rank_file_GB": res["rank_file_GB"],
        "warm_GBps": statistics.median(r["GBps"] for r in res["warm"]),
        "warm_runs_GBps": [r["GBps"] for r in res["warm"]],
        "cold_GBps": statistics.median(p["ours"]["GBps"] for p in res["cold_pairs"]),
        "disk_GBps": statistics.median(p["disk"]["GBps"] for p in res["cold_pairs"]),
        "cold_vs_disk": statistics.median(p["ratio"] for p in res["cold_pairs"]),
        "cold_vs_disk_pairs": [p["ratio"] for p in res["cold_pairs"]],
    }
    return res


def serve_tp(a: argparse.Namespace) -> dict:
    import httpx
    import ray
    from ray import serve

    from bench.serve import BASE, CONFIG_ENV, ENV, WARMUP, measure
    from deployments.app import LLMDeployment
    from deployments.config import DeploymentArgs
    dest, prep = split_pack(Path(a.work), a.shape, a.tp, a.layers, a.device)
    res: dict = {"pack": str(dest), "prep": prep, "tp": a.tp, "rounds": []}
    ray.init(runtime_env={"env_vars": {**ENV, **CONFIG_ENV}}, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    args = {"model": str(dest), "tp": a.tp, "device": a.device,
            "engine": {"max_slots": 16, "max_seq_len": 4096 if a.device == "cuda" else 256}}
    # the options build_app gives a tensor-parallel replica, with serve_config.yaml's warm-up
    dep = LLMDeployment.options(placement_group_bundles=DeploymentArgs(**args).bundles(),
                                placement_group_strategy="STRICT_PACK",
                                ray_actor_options={"num_cpus": 1, "num_gpus": int(a.device == "cuda")},
                                user_config=WARMUP)
    body = {"prompt": "The answer is ", "max_new_tokens": 16, "temperature": 0}
    try:
        for k in range(a.repeat):
            warm_cache(dest)
            for r in sorted(dest.glob("rank-*")):
                warm_cache(r)
            # (measure deletes the application after its first answer and its /stats)
            r = measure(f"coldstart-tp{a.tp}", dep.bind(**args), "/generate", body)
            res["rounds"].append(r)
        serve.run(dep.bind(**args), name="tp-decode", route_prefix="/tp-decode")
        stats = httpx.get(f"{BASE}/tp-decode/stats", timeout=30).json()
        res["ranks"] = stats.get("ranks")
        per_token = []
        for _ in range(5):
            t = time.perf_counter()
            resp = httpx.post(f"{BASE}/tp-decode/generate", timeout=300,
                              json={"prompt": "The answer is ", "max_new_tokens": 128, "temperature": 0,
                                    "ignore_eos": True})
            wall = time.perf_counter() - t
            resp.raise_for_status()
            ttft = float(resp.headers["x-coldstart-ttft-s"])
            n = resp.json()["usage"]["completion_tokens"]
            per_token.append((wall - ttft) / (n - 1) * 1e3)
        res["decode_ms_per_token_b1_http"] = per_token
    finally:
        serve.shutdown()
        ray.shutdown()
    starts = [r["start_to_running_s"] for r in res["rounds"] if "start_to_running_s" in r]
    res["summary"] = {"start_to_running_s": statistics.median(starts) if starts else None,
                      "start_runs_s": starts,
                      "decode_ms_per_token_b1": statistics.median(res["decode_ms_per_token_b1_http"])}
    return res


def channel(a: argparse.Namespace) -> dict:
    """Microseconds per mirrored decode call of B rows, for 2 and 4 ranks (see the docstring)."""
    import tempfile

    import torch.multiprocessing as mp

    from deployments.server.ranks import free_port
    detail = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (2, 4):
            out = Path(tmp) / f"tp{n}.json"
            mp.spawn(_channel_rank, args=(n, free_port(), str(out), a.calls), nprocs=n, join=True)
            detail[f"tp{n}"] = json.loads(out.read_text())
    return {"summary": {f"{k}_b{b}_us": us for k, d in detail.items() for b, us in d.items()}, "detail": detail}


def _channel_rank(rank: int, world: int, port: int, out: str, calls: int) -> None:
    import datetime

    import torch.distributed as dist

    from deployments.engine.mirror import Channel
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    ch = Channel.new()
    try:
        if rank:  # another rank: receive until stop; "sync" answers rank 0's gather
            while (msg := ch.receive())[0] != "stop":
                if msg[0] == "sync":
                    ch.gather(None)
            return
        res = {}
        for B in (1, 16, 64, 128, 256):
            rows = [(i, 31000 + i, 1000 + i) for i in range(B)]  # (slot, token, position), as the engine sends
            t = time.perf_counter()
            for _ in range(calls):
                ch.send(("decode", (B, 2048, rows)))
            ch.send(("sync", ()))
            ch.gather(None)  # every rank has received them all
            res[B] = round((time.perf_counter() - t) / calls * 1e6, 1)
        ch.send(("stop", ()))
        Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["rank-load", "serve", "channel"])
    ap.add_argument("--work", default="/tmp/coldstart-bench")
    ap.add_argument("--out", default=str(ROOT / "bench" / "work"))
    ap.add_argument("--layers", type=int, help="write only this many of the shape's layers (to fit the disk)")
    ap.add_argument("--repeats", type=int, default=3, help="rank-load: warm loads")
    ap.add_argument("--cold-pairs", type=int, default=3, help="rank-load: cold loads, each after a disk read")
    ap.add_argument("--shape", default="llama3-70b", help="serve: llama2-13b or llama3-70b")
    ap.add_argument("--tp", type=int, default=4, help="serve: ranks per replica (GPUs)")
    ap.add_argument("--repeat", type=int, default=3, help="serve: deploys, each timed")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="serve: cpu checks the script")
    ap.add_argument("--calls", type=int, default=500, help="channel: decode calls per batch size")
    a = ap.parse_args()
    if a.what == "rank-load" and not drop_caches():
        print("the cold figures below are warm: the page cache could not be dropped", flush=True)
    res = {"rank-load": rank_load, "serve": serve_tp, "channel": channel}[a.what](a)
    res["command"] = "PYTHONPATH=$PWD python bench/tp.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = {"rank-load": "tp-rank-load.json", "channel": "tp-channel.json"}.get(a.what, f"tp-serve-{a.shape}-tp{a.tp}.json")
    (out / name).write_text(json.dumps(stamp(res), indent=2))
    print(json.dumps(res["summary"], indent=2))


if __name__ == "__main__":
    main()
