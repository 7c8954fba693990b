"""Tokens per second through Ray Serve's HTTP front, at a number of concurrent requests.

    PYTHONPATH=$PWD python bench/throughput.py --packed /tmp/coldstart-bench/packed \\
        --engine '{"kv_cache": "paged", "max_slots": 128, "max_seq_len": 4096}' --concurrency 64,128 --out OUT

Deploys one replica of the application (one GPU, serve_config.yaml's warm-up) with the given
`args.engine`, then for each concurrency C sends C `/generate` requests at once, shared out over
--clients processes that all send from one instant (prompts of
--prompt-len tokens as the replica counts them, each begun with its own number so that no two
requests of the run share a prefix: the paged cache's prefix reuse stays out of the figure, as in
the engine's random prompts; --new-tokens greedy tokens each, end of sequence ignored) and times
them from that instant to the last answer: total completion
tokens / wall seconds, the figure `bench/engine.py --concurrency` gives for the engine alone
(run it in the same session: the ratio is what counts on a shared host). Each concurrency runs
--rounds times; the median counts. Beside each burst: the engine's steps, shared prefills and
busy time in it (from `/stats`, as `bench/engine.py` records them), and the median request's
time outside the engine (its wait at the client less the `x-coldstart-engine-s` header), which
tell an HTTP path's cost apart from an engine that worked differently under it. --stream: each
concurrency's rounds again with every answer streamed (`"stream": true`, a line per chunk, read as
it comes), against the same replica.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.meta import stamp  # noqa: E402


def prompt_texts(packed: Path, n: int, count: int) -> list[str]:
    """``count`` texts of ``n`` tokens as the replica counts them (its tokenizer, with its special
    tokens), each begun with its own number, so that no two share a prefix: the demo corpus,
    repeated, cut to length. The same length as `bench/engine.py --prompt-len`'s prompts, so both
    pad to one prefill length (a prompt a few tokens longer pads to twice it)."""
    from deployments.engine.tokenizer import Tokenizer
    from weights.demo import _CORPUS
    tok = Tokenizer.from_dir(packed)
    corpus = tok.encode(_CORPUS * (1 + n // 20), add_special_tokens=False)
    out = []
    for _ in range(count):
        head = f"{next(_SENT)}. "
        k = n - len(tok.encode(head))
        while k > 0 and len(tok.encode(text := head + tok.decode(corpus[:k]))) > n:
            k -= 1  # (a decoded text may tokenize a token longer)
        out.append(text)
    return out


_SENT = itertools.count()  # every request's number, over all bursts


SAMPLED = ("capacity_ratio", "running", "waiting", "kv_blocks_free")


async def sample_stats(base: str, every_s: float, into: list, t0: float) -> None:
    """The replica's ``/stats`` every ``every_s`` until cancelled (over a connection of its own):
    its capacity share (what its autoscaling policy reads), running and waiting sequences and free
    KV blocks (``SAMPLED``); each sample's ``t`` in seconds from ``t0`` (``time.time()``)."""
    import httpx
    async with httpx.AsyncClient(timeout=60) as client:
        while True:
            st = (await client.get(f"{base}/stats")).json()
            into.append({"t": round(time.time() - t0, 3), "capacity_ratio": st.get("capacity_ratio"),
                         **{k: st["engine"].get(k) for k in SAMPLED[1:]}})
            await asyncio.sleep(every_s)


async def _send(url: str, bodies: list[dict], stream: bool, start_at: float) -> list:
    """Every request of ``bodies`` at once from ``start_at`` (``time.time()``), over one client:
    each one's record (None or an exception where it failed), its end an absolute time."""
    import httpx
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))

    async def one(client: httpx.AsyncClient, body: dict) -> dict | None:
        t = time.perf_counter()
        if not stream:
            r = await client.post(url, json=body)
            if r.status_code != 200:
                return None
            engine_s, route_s = (r.headers.get(f"x-coldstart-{k}-s") for k in ("engine", "route"))
            s, usage = time.perf_counter() - t, r.json()["usage"]
            return {"s": s, "end": time.time(), "tokens": usage["completion_tokens"],
                    "prompt_tokens": usage["prompt_tokens"],
                    "outside_s": s - float(engine_s) if engine_s else None,
                    # of it, in the route (parsing, tokenizing, waits for the replica's event loop), and
                    # on the way to and from it (Ray's proxy and router, the replica's own handling)
                    "route_s": float(route_s) - float(engine_s) if engine_s and route_s else None,
                    "path_s": s - float(route_s) if route_s else None}
        tokens, reason = 0, None
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():
                if line.strip():
                    chunk = json.loads(line)
                    tokens, reason = tokens + len(chunk["token_ids"]), chunk["finish_reason"]
        return None if reason in (None, "error") else {"s": time.perf_counter() - t, "end": time.time(),
                                                        "tokens": tokens}
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return list(await asyncio.gather(*(one(client, b) for b in bodies), return_exceptions=True))


def client_share(url: str, bodies: list[dict], stream: bool, start_at: float) -> list:
    """One client process's share of a burst (``_send``), its exceptions as text."""
    return [repr(r) if isinstance(r, BaseException) else r for r in asyncio.run(_send(url, bodies, stream, start_at))]


async def burst(url: str, texts: list[str], new_tokens: int, stream: bool = False, sample_s: float = 0,
                clients: Any = None, n_clients: int = 1) -> dict:
    """``c`` concurrent requests: wall seconds, completion tokens, failures, and where a request's
    time went (the median of its wait at the client less its time in the engine, the
    ``x-coldstart-engine-s`` header: the HTTP path's share). ``stream``: each answer streamed,
    a line per chunk, read as it comes (its tokens counted from the lines; no header then).
    ``sample_s``: the replica's ``/stats`` sampled that often meanwhile (``sample_stats``), with
    the least capacity share it reported. ``clients``: a pool of ``n_clients`` processes that share
    the requests out, all sent from one instant (one Python client serialises its own sends: 128
    requests cost it a few hundred ms); None: this process sends them all."""
    c = len(texts)
    bodies = [{"prompt": t, "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
               **({"stream": True} if stream else {})} for t in texts]
    samples: list = []
    start_at = time.time() + (0.2 if clients is not None else 0.0)
    sampler = (asyncio.create_task(sample_stats(url.rsplit("/", 1)[0], sample_s, samples, start_at))
               if sample_s else None)
    if clients is None:
        rs = await _send(url, bodies, stream, start_at)
    else:
        loop = asyncio.get_running_loop()
        shares = await asyncio.gather(*(loop.run_in_executor(clients, client_share, url, bodies[i::n_clients],
                                                             stream, start_at) for i in range(n_clients)))
        rs = [r for share in shares for r in share]
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    ok = [r for r in rs if isinstance(r, dict)]
    wall = max(r["end"] for r in ok) - start_at if ok else float("nan")

    def median(key: str) -> float | None:
        v = [r[key] for r in ok if r.get(key) is not None]
        return statistics.median(v) if v else None
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in ok), "failed": c - len(ok),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in ok if "prompt_tokens" in r}),
            "request_s_median": statistics.median(r["s"] for r in ok) if ok else None,
            "outside_engine_s_median": median("outside_s"),
            "route_s_median": median("route_s"), "path_s_median": median("path_s"),
            **({"stats_samples": samples, "capacity_ratio_min": min(x["capacity_ratio"] for x in samples),
                # the first sample that saw every request in the engine (running or waiting): how long
                # the HTTP path took to hand the whole burst over
                "all_in_engine_s": next((x["t"] for x in samples if x["running"] + x["waiting"] >= c), None)}
               if samples else {})}


def _ready(_: int) -> bool:
    """A client process's imports, made before its first burst."""
    import httpx
    return httpx is not None


def engine_work(base: str) -> dict:
    """The replica engine's counters that tell a burst's work apart (``/stats``)."""
    import httpx

    from bench.engine import WORK
    e = httpx.get(f"{base}/stats", timeout=30).json()["engine"]
    return {k: e[k] for k in WORK}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packed", default="/tmp/coldstart-bench/packed")
    ap.add_argument("--engine", type=json.loads, default={}, help="args.engine, as JSON")
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[16, 64, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream", action="store_true",
                    help="each concurrency's rounds streamed as well (answers read line by line)")
    ap.add_argument("--num-gpus", type=float, default=1, help="0: check the script on a CPU machine")
    ap.add_argument("--clients", type=int, default=8, metavar="N",
                    help="client processes that share each burst's requests out, all sent from one instant "
                         "(1: this process sends them all)")
    ap.add_argument("--sample-s", type=float, default=0, metavar="S",
                    help="sample the replica's /stats every S seconds during each burst (its capacity share, "
                         "running and waiting sequences, free KV blocks)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the replica and Ray's processes (repeatable); the result file is "
                         "named after them")
    ap.add_argument("--out", default=str(ROOT / "bench" / "work"))
    a = ap.parse_args()
    import ray
    from ray import serve

    from bench.serve import BASE, CONFIG_ENV, ENV, WARMUP
    from deployments.app import LLMDeployment
    packed = Path(a.packed)
    extra = dict(e.split("=", 1) for e in a.env)
    os.environ.update(extra)  # and Ray's own processes (Serve's proxy and controller) inherit them
    ray.init(runtime_env={"env_vars": {**ENV, **CONFIG_ENV, **extra}}, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    most = max(a.concurrency)
    dep = LLMDeployment.options(ray_actor_options={"num_gpus": a.num_gpus, "num_cpus": 1}, user_config=WARMUP,
                                max_ongoing_requests=most + 8, max_queued_requests=most)
    res: dict = {"engine": a.engine, "env": extra, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                 "clients": a.clients, "runs": {},
                 **({"runs_stream": {}} if a.stream else {})}
    clients = None
    if a.clients > 1:  # started (and their imports made) before the first burst; spawned: no fork of Ray's threads
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        clients = ProcessPoolExecutor(a.clients, mp_context=multiprocessing.get_context("spawn"))
        list(clients.map(_ready, range(a.clients)))
    try:
        serve.run(dep.bind(model=str(packed), device="cuda" if a.num_gpus else "cpu", engine=a.engine),
                  name="tput", route_prefix="/tput")
        url = f"{BASE}/tput/generate"
        asyncio.run(burst(url, prompt_texts(packed, a.prompt_len, min(4, most)), 8))  # one-time costs, not timed
        for mode in ("plain", "stream") if a.stream else ("plain",):
            for c in a.concurrency:
                runs = []
                for _ in range(a.rounds):
                    texts = prompt_texts(packed, a.prompt_len, c)
                    before = engine_work(f"{BASE}/tput")
                    r = asyncio.run(burst(url, texts, a.new_tokens, stream=mode == "stream", sample_s=a.sample_s,
                                          clients=clients, n_clients=a.clients))
                    time.sleep(0.05)  # (the loop's last turn ends after the last answer: as bench/engine.py)
                    after = engine_work(f"{BASE}/tput")
                    # the engine's share of the burst: its steps, shared prefills and busy time
                    r["engine"] = {k: after[k] - before[k] for k in after}
                    r["tokens_per_s"] = r["tokens"] / r["wall_s"]
                    runs.append(r)
                    outside, e = r["outside_engine_s_median"], r["engine"]
                    print(f"  {c:4d} concurrent{' streamed' if mode == 'stream' else ''}: {r['tokens_per_s']:9.1f} "
                          f"tokens/s ({r['tokens']} tokens in {r['wall_s']:.2f} s, {r['failed']} failed); engine busy "
                          f"{e['busy_s']:.2f} s (prefill {e['prefill_s']:.2f} s, decode "
                          f"{e['decode_s'] / max(e['steps'], 1) * 1e3:.2f} ms a step), {e['steps']} steps, "
                          f"{e['batched_prefills']} shared prefills; a request {r['request_s_median']:.2f} s"
                          + (f", {outside:.3f} s of it outside the engine ({r['route_s_median']:.3f} s in the route, "
                             f"{r['path_s_median']:.3f} s to and from it; medians)" if outside is not None else "")
                          + (f"; capacity share at least {r['capacity_ratio_min']:.3f}, at most "
                             f"{max(x['running'] for x in r['stats_samples'])} running, all in the engine after "
                             f"{r['all_in_engine_s']} s" if "capacity_ratio_min" in r else ""), flush=True)
                res["runs" if mode == "plain" else "runs_stream"][c] = runs
        import httpx
        res["replica_engine"] = httpx.get(f"{BASE}/tput/stats", timeout=30).json()["engine"]
    finally:
        if clients is not None:
            clients.shutdown()
        serve.shutdown()
        ray.shutdown()
    res["summary"] = {f"tokens_per_s{'_stream' if key == 'runs_stream' else ''}_c{c}":
                      statistics.median(r["tokens_per_s"] for r in runs)
                      for key in ("runs", "runs_stream") for c, runs in res.get(key, {}).items()}
    res["command"] = "PYTHONPATH=$PWD python bench/throughput.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "-".join(["throughput", a.engine.get("kv_cache", "static"), *(f"{k}{v}" for k, v in extra.items()),
                     *([f"prompt{a.prompt_len}"] if a.prompt_len != 128 else [])])
    name = re.sub(r"[^a-z0-9_.=-]+", "_", name.replace("COLDSTART_", "").lower())[:120] + ".json"
    (out / name).write_text(json.dumps(stamp(res), indent=2))
    print(json.dumps(res["summary"], indent=2))


if __name__ == "__main__":
    main()
