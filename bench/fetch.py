"""A remote model's transfer measured beside the raw speed of its source, on one GPU host.

    PYTHONPATH=$PWD python bench/fetch.py --packed /tmp/coldstart-bench/packed --out OUT/fetch.json \
        [--parts source,peer,serve] [--parts together --nodes 3]

source  A local source (``bench/file_server.py``: 16 processes, ``sendfile`` from the page cache,
        S3 path-style GET/HEAD) serving the packed 7B. Side by side, alternating: a plain parallel
        read of the weight file's data region through obstore (16 threads, 16 MiB ranged GETs, the
        bytes received and dropped), the same through boto3 where it is installed, and
        ``weights.load("s3://...", "cuda")`` into an empty node cache (the bytes into the GPU and
        the cache, each piece checked). Then the load again from the node's copy, and the local
        packed directory's load for reference.
peer    Two Ray nodes on this host (``ray.cluster_utils.Cluster``): node a holds the model in its
        cache (from ``source``), node b (the GPU) none. Side by side: a plain parallel read of the
        data region from a's node service through Ray (16 threads), and b's load, which takes every
        piece from a.
together  Several Ray nodes on this host (``--nodes``), none holding the model, fetch it at once
        from the source into their node caches (``Fetch.run``, 16 threads; no GPU): how many
        copies of the model the source sent, how much the nodes took from each other, and each
        node's time. Runs on a CPU host too. ``--store LATENCY_MS,EGRESS_MBPS`` paces the source
        as an object store that is the limit (the fleet's case, docs/fleet.md).
serve   Ray Serve on this GPU: a replica's start (Ray added -> RUNNING) with the packed model on
        the node, then with the model at the source and an empty node cache, alternating; and a
        deployment scaled to zero: its first request's answer beside that replica's start.
Every figure is of this run; the ratios are what a run is judged on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.meta import commit  # noqa: E402
from bench.results import raw_best  # noqa: E402

WORK = Path(tempfile.gettempdir()) / "coldstart-fetch"
PIECE = 16 << 20
THREADS = 16
DEV = "cuda"  # cpu where torch sees no GPU: a check of the script itself
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_source(packed: Path, store: tuple[float, float] | None = None) -> tuple[subprocess.Popen, str]:
    """The file server over WORK/www, where bucket ``bench`` holds the packed model; sets the S3
    variables (endpoint, dummy keys) in this process's environment. Returns it and the URI.
    ``store``: (first-byte latency ms, total egress MB/s): one process, paced as an object store."""
    www = WORK / "www" / "bench"
    shutil.rmtree(WORK / "www", ignore_errors=True)
    www.mkdir(parents=True)
    (www / "llama-7b").symlink_to(packed.resolve())
    port = _port()
    pace = ["--procs", "16"] if store is None else ["--procs", "1", "--latency-ms", str(store[0]),
                                                    "--egress-mbps", str(store[1])]
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "file_server.py"), str(WORK / "www"),
                             "--port", str(port), *pace])
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc, "s3://bench/llama-7b"


def _pieces(packed: Path) -> list[tuple[int, int]]:
    from weights.format import read_packed
    pf = read_packed(packed)
    n = pf.data_bytes
    return [(pf.data_offset + o, min(PIECE, n - o)) for o in range(0, n, PIECE)]


def raw_obstore(uri: str, pieces: list[tuple[int, int]], threads: int = THREADS) -> dict:
    """A plain parallel read: ranged GETs, the bytes received and dropped."""
    import obstore
    from obstore.store import from_url
    store = from_url(uri, client_options={"allow_http": True})
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda p: len(obstore.get_range(store, "model.cst", start=p[0], length=p[1])), pieces))
    s = time.perf_counter() - t0
    return {"bytes": total, "seconds": s, "GBps": total / s / 1e9}


def raw_direct(uri: str, pieces: list[tuple[int, int]], threads: int = THREADS) -> dict:
    """A plain parallel read through the client the transfer reads with (``weights.remote``'s
    ranged GETs into the caller's memory): each thread's one buffer, filled and refilled."""
    import numpy as np

    from weights.remote import Origin
    origin = Origin(uri)
    bufs = threading.local()

    def one(p: tuple[int, int]) -> int:
        if not hasattr(bufs, "b"):
            bufs.b = np.ones(PIECE, np.uint8)  # (its pages touched before the timing counts them)
        origin.read_into("model.cst", p[0], memoryview(bufs.b)[:p[1]])
        return p[1]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, pieces[:threads]))
        t0 = time.perf_counter()
        total = sum(pool.map(one, pieces))
    s = time.perf_counter() - t0
    return {"bytes": total, "seconds": s, "GBps": total / s / 1e9}


def raw_boto3(uri: str, pieces: list[tuple[int, int]]) -> dict | None:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None
    bucket, key = uri[5:].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                      config=Config(max_pool_connections=THREADS))

    def one(p: tuple[int, int]) -> int:
        body = s3.get_object(Bucket=bucket, Key=f"{key}/model.cst", Range=f"bytes={p[0]}-{p[0] + p[1] - 1}")["Body"]
        return len(body.read())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        total = sum(pool.map(one, pieces))
    s = time.perf_counter() - t0
    return {"bytes": total, "seconds": s, "GBps": total / s / 1e9}


def load_remote(uri: str, cache_dir: Path) -> dict:
    """``weights.load`` of the URI onto the GPU, the node cache at ``cache_dir``; its phases."""
    from weights import load
    from weights.cache import NodeCache
    from weights.fetch import Fetch, resolve
    t0 = time.perf_counter()
    f = resolve(uri, NodeCache(cache_dir))
    resolved = time.perf_counter() - t0
    m = load(f, DEV)
    _sync()
    wall = time.perf_counter() - t0
    phases = {p.name: {"seconds": p.seconds, **({"GBps": p.gbps} if p.gbps else {})} for p in m.timer.phases}
    out = {"wall_s": wall, "resolve_s": resolved, "bytes": m.packed.data_bytes, "GBps": m.packed.data_bytes / wall / 1e9,
           "phases": phases}
    if isinstance(f, Fetch):
        # on a GPU the cache's file is written behind the device's copies: when it is whole too
        f.cached(600)
        cached = f.committed_at - t0
        out["cached_s"], out["cached_GBps"] = cached, m.packed.data_bytes / cached / 1e9
        out["busy_s"] = dict(f.stats.busy_s)  # the threads' busy seconds by step (which one limits it)
        out["idle_s"] = dict(f.stats.idle_s)  # the device readers' seconds outside their reads, by cause
    del m
    _sync(empty=True)
    return out


def _sync(empty: bool = False) -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if empty:
            torch.cuda.empty_cache()


def load_local(packed: Path) -> dict:
    from weights import load
    t0 = time.perf_counter()
    m = load(packed, DEV)
    _sync()
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "GBps": m.packed.data_bytes / wall / 1e9}
    del m
    _sync(empty=True)
    return out


def part_source(packed: Path, uri: str, rounds: int) -> dict:
    pieces = _pieces(packed)
    res: dict = {"rounds": []}
    raw_obstore(uri, pieces[:8])  # connections and the page cache of the served file, before timing
    for i in range(rounds):
        cache = WORK / f"cache-source-{i}"
        shutil.rmtree(cache, ignore_errors=True)
        r = {"raw_obstore": raw_obstore(uri, pieces), "raw_direct": raw_direct(uri, pieces),
             "pipeline": load_remote(uri, cache)}
        b = raw_boto3(uri, pieces)
        if b is not None:
            r["raw_boto3"] = b
        raw = raw_best(r)
        r["ratio"] = r["pipeline"]["GBps"] / raw
        r["cached_ratio"] = r["pipeline"]["cached_GBps"] / raw
        fetch = r["pipeline"]["phases"].get("fetch", {})
        r["fetch_ratio"] = fetch.get("GBps", 0) / raw
        print(f"source round {i}: raw obstore {r['raw_obstore']['GBps']:.2f} GB/s, raw into a buffer "
              f"{r['raw_direct']['GBps']:.2f}" + (f", raw boto3 {b['GBps']:.2f}" if b else "")
              + f"; load to GPU {r['pipeline']['GBps']:.2f} GB/s (fetch phase {fetch.get('GBps', 0):.2f}), "
              f"ratio {r['ratio']:.3f}; the node cache whole at {r['pipeline']['cached_GBps']:.2f} GB/s, "
              f"ratio {r['cached_ratio']:.3f}", flush=True)
        res["rounds"].append(r)
        if i < rounds - 1:
            shutil.rmtree(cache, ignore_errors=True)
    res["node_copy"] = load_remote(uri, WORK / f"cache-source-{rounds - 1}")
    res["local_packed"] = load_local(packed)
    print(f"from the node's copy {res['node_copy']['GBps']:.2f} GB/s; the packed directory "
          f"{res['local_packed']['GBps']:.2f} GB/s", flush=True)
    res["cache_with_model"] = str(WORK / f"cache-source-{rounds - 1}")
    res["one_connection"] = raw_obstore(uri, pieces[:16], threads=1)
    return res


def fleet_fields(source: dict) -> dict:
    """What ``bench/fleet.py --check`` reads: this host's transfer and its limits (docs/fleet.md)."""
    best = max(source["rounds"], key=lambda r: r["pipeline"]["phases"].get("fetch", {}).get("GBps", 0))
    return {"model_bytes": best["pipeline"]["bytes"], "fetch_gbps": best["pipeline"]["phases"]["fetch"]["GBps"],
            "source_gbps": max(raw_best(r) for r in source["rounds"]),
            "connection_mbps": source["one_connection"]["GBps"] * 1000, "nic_gbits": None,
            "threads": THREADS, "piece_mib": PIECE >> 20}


def part_peer(packed: Path, uri: str, held_cache: Path, rounds: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster
    env = {k: os.environ[k] for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    cluster = Cluster()
    cluster.add_node(num_cpus=8, num_gpus=0, resources={"node_a": 1}, include_dashboard=False,
                     object_store_memory=4 << 30, env_vars={**env, "COLDSTART_CACHE_DIR": str(held_cache)})
    res: dict = {"rounds": []}
    pieces = _pieces(packed)
    own_service, raw_peer, peer_load = _remote_fns()
    try:
        for i in range(rounds):
            empty = WORK / f"cache-peer-{i}"
            shutil.rmtree(empty, ignore_errors=True)
            node = cluster.add_node(num_cpus=8, num_gpus=1 if DEV == "cuda" else 0, resources={"node_b": 1}, object_store_memory=4 << 30,
                                    env_vars={**env, "COLDSTART_CACHE_DIR": str(empty)})
            cluster.wait_for_nodes()
            if not ray.is_initialized():
                ray.init(address=cluster.address, log_to_driver=True)
            ray.get(own_service.options(resources={"node_a": 0.01}).remote())
            raw = ray.get(raw_peer.options(resources={"node_b": 0.01}).remote(pieces))
            pipe = ray.get(peer_load.options(resources={"node_b": 0.01}, num_gpus=1 if DEV == "cuda" else 0)
                           .remote(uri, DEV))
            r = {"raw_ray": raw, "pipeline": pipe, "ratio": pipe["GBps"] / raw["GBps"]}
            print(f"peer round {i}: raw Ray read {raw['GBps']:.2f} GB/s; load to GPU + cache from the peer "
                  f"{pipe['GBps']:.2f} GB/s (from {pipe['bytes_from']}), ratio {r['ratio']:.3f}", flush=True)
            res["rounds"].append(r)
            cluster.remove_node(node)
            shutil.rmtree(empty, ignore_errors=True)  # (the disk holds few copies of a 7B)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return res


def part_together(uri: str, rounds: int, nodes: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster
    env = {k: os.environ[k] for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    cluster = Cluster()
    cluster.add_node(num_cpus=1, include_dashboard=False, object_store_memory=1 << 30, env_vars=env)
    ray.init(address=cluster.address, log_to_driver=True)
    fetch_here = ray.remote(num_cpus=0)(_fetch_here)
    res: dict = {"nodes": nodes, "rounds": []}
    try:
        for i in range(rounds):
            caches = [WORK / f"cache-together-{i}-{n}" for n in range(nodes)]
            added = []
            for n, c in enumerate(caches):  # new nodes each round: no service remembers a copy
                shutil.rmtree(c, ignore_errors=True)
                added.append(cluster.add_node(num_cpus=2, resources={f"node_{n}": 1}, object_store_memory=1 << 30,
                                              env_vars={**env, "COLDSTART_CACHE_DIR": str(c)}))
            cluster.wait_for_nodes()
            got = ray.get([fetch_here.options(resources={f"node_{n}": 0.01}).remote(uri) for n in range(nodes)])
            data = got[0]["data_bytes"]
            source = sum(g["bytes_from"].get(uri, 0) for g in got)
            r = {"nodes": got, "source_copies": source / data,
                 "peer_copies": sum(sum(v for k, v in g["bytes_from"].items() if k != uri) for g in got) / data,
                 "wall_s": max(g["wall_s"] for g in got)}
            print(f"together round {i}: {nodes} nodes, the source sent {r['source_copies']:.2f} copies, peers "
                  f"{r['peer_copies']:.2f}; the last node done in {r['wall_s']:.2f} s", flush=True)
            res["rounds"].append(r)
            for node in added:
                cluster.remove_node(node)
            for c in caches:
                shutil.rmtree(c, ignore_errors=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return res


def _fetch_here(uri: str) -> dict:
    """On the node the task is pinned to: the model into its empty cache, from peers and the source."""
    from deployments.node_cache import model_cache
    from deployments.peers import RayPeers
    from weights.fetch import Fetch, resolve
    cache = model_cache()
    t0 = time.perf_counter()
    f = resolve(uri, cache, peers=RayPeers(cache.root))
    assert isinstance(f, Fetch), f
    f.run(threads=THREADS, piece_bytes=PIECE)
    return {"wall_s": time.perf_counter() - t0, "data_bytes": f.packed.data_bytes, "bytes_from": f.stats.bytes_from,
            "dropped": f.stats.dropped, "busy_s": f.stats.busy_s}


def _remote_fns():
    import ray

    @ray.remote(num_cpus=0)
    def own_service() -> str:
        from deployments.node_cache import model_cache
        from deployments.peers import RayPeers
        p = RayPeers(model_cache().root)
        return ray.get(p.own.ping.remote())

    @ray.remote(num_cpus=0)
    def raw_peer(pieces: list) -> dict:
        from deployments.peers import NAMESPACE, PREFIX
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(PREFIX)
                 and a["name"] != PREFIX + ray.get_runtime_context().get_node_id()]
        h = ray.get_actor(names[0], namespace=NAMESPACE)
        root = Path(ray.get(h.ping.remote()))
        f = next(root.rglob("model.cst"))
        key = f.parent.name

        def one(p):
            a = ray.get(h.read.remote(key, "model.cst", p[0], p[1]))
            return a.nbytes
        t0 = time.perf_counter()
        with ThreadPoolExecutor(THREADS) as pool:
            total = sum(pool.map(one, pieces))
        s = time.perf_counter() - t0
        return {"bytes": total, "seconds": s, "GBps": total / s / 1e9}

    @ray.remote(num_cpus=0)
    def peer_load(uri: str, dev: str) -> dict:
        import torch

        from deployments.node_cache import model_cache
        from deployments.peers import RayPeers
        from weights import load
        from weights.fetch import Fetch, resolve
        cache = model_cache()
        peers = RayPeers(cache.root)
        t0 = time.perf_counter()
        f = resolve(uri, cache, peers=peers)
        assert isinstance(f, Fetch), f
        m = load(f, dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        f.cached(600)
        cached = f.committed_at - t0
        return {"wall_s": wall, "GBps": m.packed.data_bytes / wall / 1e9, "cached_s": cached,
                "cached_GBps": m.packed.data_bytes / cached / 1e9, "bytes_from": f.stats.bytes_from,
                "dropped": f.stats.dropped, "busy_s": f.stats.busy_s, "idle_s": f.stats.idle_s,
                "phases": {p.name: p.seconds for p in m.timer.phases}}
    return own_service, raw_peer, peer_load


def _shipped_zero_autoscaling() -> dict:
    """serve_config.zero.yaml's autoscaling settings (the policy left out: it reads /stats)."""
    import yaml
    cfg = yaml.safe_load((ROOT / "serve_config.zero.yaml").read_text())
    dep = next(d for d in cfg["applications"][0]["deployments"] if d["name"] == "LLMDeployment")
    return {k: v for k, v in dep["autoscaling_config"].items() if k != "policy"}


def from_zero(name: str, app, body: dict) -> dict:
    """``app`` deployed with no replica, then one request: when it was answered, when Ray added its
    replica, and that replica's start (Ray added -> RUNNING)."""
    import httpx
    from ray import serve

    from bench.serve import ray_view
    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    while str(getattr(serve.status().applications.get(name), "status", "")).split(".")[-1] != "RUNNING":
        time.sleep(0.1)
    time.sleep(1.0)  # (the proxy's routes settled, as for a user who comes later)
    sent = time.time()
    r = httpx.post(f"http://127.0.0.1:8000/{name}/generate", json=body, timeout=600)
    answered = time.time()
    seen = ray_view(name)
    out = {"status": r.status_code, "first_answer_s": answered - sent, "added_after_request_s": seen["added_at"] - sent,
           "start_to_running_s": seen.get("running_at", float("nan")) - seen["added_at"]}
    print(f"  {name}: first answer {out['first_answer_s']:.2f} s after the request; its replica added "
          f"{out['added_after_request_s']:.2f} s after it, started in {out['start_to_running_s']:.2f} s", flush=True)
    serve.delete(name)
    return out


def part_serve(packed: Path, uri: str, rounds: int, res: dict, zero_only: bool = False) -> None:
    """Fills ``res`` as each start is measured (a run cut short keeps the rounds it finished)."""
    import ray
    from ray import serve

    from bench.serve import CONFIG_ENV, ENV, WARMUP, Minimal, measure
    from deployments.app import LLMDeployment
    s3 = {k: os.environ[k] for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    ray.init(runtime_env={"env_vars": {**ENV, **s3}}, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    body = {"prompt": "The answer is ", "max_new_tokens": 16, "temperature": 0}
    measure("prime", Minimal.bind(True), "", {})

    def app(model: str, env: dict, **opts):
        dep = LLMDeployment.options(ray_actor_options={"num_gpus": 1 if DEV == "cuda" else 0, "runtime_env": {"env_vars": {
            **ENV, **CONFIG_ENV, **s3, **env}}}, user_config=WARMUP, **opts)
        return dep.bind(model=model, device=DEV, engine={"max_slots": 16, "max_seq_len": 4096 if DEV == "cuda" else 512})
    res["rounds"] = []
    for i in range(0 if zero_only else rounds):
        local = measure(f"coldstart-local-{i}", app(str(packed), {"COLDSTART_EARLY_WEIGHTS": str(packed)}),
                        "/generate", body)
        cache = WORK / f"cache-serve-{i}"
        shutil.rmtree(cache, ignore_errors=True)
        remote = measure(f"coldstart-remote-{i}", app(uri, {"COLDSTART_CACHE_DIR": str(cache)}), "/generate", body)
        held = measure(f"coldstart-held-{i}", app(uri, {"COLDSTART_CACHE_DIR": str(cache)}), "/generate", body)
        res["rounds"].append({"local": local, "remote_empty_cache": remote, "remote_node_copy": held})
        shutil.rmtree(cache, ignore_errors=True)
    # scale from zero: the application up with no replica, then one request; Ray's autoscaling
    # defaults beside the shipped scale-to-zero config's settings
    zero = {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1, "target_ongoing_requests": 16,
            "downscale_delay_s": 600}
    shipped = _shipped_zero_autoscaling()
    res["scale_from_zero"] = []
    for i in range(rounds):
        for tag, cfg in (("defaults", zero), ("shipped", {**shipped, "max_replicas": 1})):
            res["scale_from_zero"].append({"config": tag, "autoscaling": cfg, **from_zero(
                f"coldstart-zero-{tag}-{i}", app(str(packed), {"COLDSTART_EARLY_WEIGHTS": str(packed)},
                                                 autoscaling_config=cfg), body)})
    serve.shutdown()
    ray.shutdown()


def main() -> None:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", default="/tmp/coldstart-bench/packed",
                    help="the packed model to serve (the default: the 7B random checkpoint, made there if absent)")
    ap.add_argument("--out", required=True, help="the result file (JSON)")
    ap.add_argument("--parts", default="source,peer,serve")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--held-cache", help="peer: a node cache that holds the model already (an earlier "
                    "run's source part), instead of running that part first")
    ap.add_argument("--nodes", type=int, default=3, help="together: how many nodes fetch at once")
    ap.add_argument("--store", help="LATENCY_MS,EGRESS_MBPS: the source paced as an object store (one process)")
    ap.add_argument("--zero-only", action="store_true", help="serve: only the scale-from-zero rounds")
    a = ap.parse_args()
    packed = Path(a.packed)
    if not (packed / "model.cst").exists() and packed == Path("/tmp/coldstart-bench/packed"):
        from bench.load import ensure_checkpoint
        ensure_checkpoint(packed.parent, "llama-7b")
    import torch
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    WORK.mkdir(parents=True, exist_ok=True)
    out: dict = {"host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "packed": str(packed)}
    out["gpu"] = torch.cuda.get_device_name() if DEV == "cuda" else None
    out["commit"] = commit()
    store = tuple(float(x) for x in a.store.split(",")) if a.store else None
    out["store"] = store
    server, uri = start_source(packed, store)
    parts = a.parts.split(",")
    try:
        if "source" in parts or ("peer" in parts and not a.held_cache):
            out["source"] = part_source(packed, uri, a.rounds)
            out.update(fleet_fields(out["source"]))
        Path(a.out).write_text(json.dumps(out, indent=1))
        if "peer" in parts:
            held = Path(a.held_cache) if a.held_cache else Path(out["source"]["cache_with_model"])
            out["peer"] = part_peer(packed, uri, held, a.rounds)
            Path(a.out).write_text(json.dumps(out, indent=1))
        if "together" in parts:
            out["together"] = part_together(uri, a.rounds, a.nodes)
            Path(a.out).write_text(json.dumps(out, indent=1))
        if "serve" in parts:
            out["serve"] = {}
            part_serve(packed, uri, a.rounds, out["serve"], a.zero_only)
    finally:  # (also on SIGINT: `timeout -s INT` keeps what was measured)
        server.terminate()
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
