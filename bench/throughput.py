"""Tokens per second through Ray Serve's HTTP front, at a number of concurrent requests.

    PYTHONPATH=$PWD python bench/throughput.py --packed /tmp/coldstart-bench/packed \\
        --engine '{"kv_cache": "paged", "max_slots": 128, "max_seq_len": 4096}' --concurrency 64,128 --out OUT

Deploys one replica of the application (one GPU, serve_config.yaml's warm-up) with the given
`args.engine`, then for each concurrency C sends C `/generate` requests at once (prompts of
--prompt-len tokens of the model's own tokenizer, each begun with its own number so that no two
requests of the run share a prefix (the paged cache's prefix reuse stays out of the figure, as in the engine's random
prompts), --new-tokens greedy tokens each, end of sequence ignored) and times them from the first send to the last answer: total completion
tokens / wall seconds, the figure `bench/engine.py --concurrency` gives for the engine alone
(run it in the same session: the ratio is what counts on a shared host). Each concurrency runs
--rounds times; the median counts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompt_text(packed: Path, n: int) -> str:
    """About ``n`` tokens of text in the model's tokenizer (the demo corpus, repeated)."""
    from deployments.engine.tokenizer import Tokenizer
    from weights.demo import _CORPUS
    tok = Tokenizer.from_dir(packed)
    ids = tok.encode(_CORPUS * (1 + n // 50), add_special_tokens=False)[:n]
    return tok.decode(ids)


_SENT = itertools.count()  # every request's number, over all bursts


async def burst(url: str, text: str, c: int, new_tokens: int) -> tuple[float, int, int]:
    """(wall seconds, completion tokens, failures) of ``c`` concurrent requests."""
    import httpx
    bodies = [{"prompt": f"{next(_SENT)}. {text}", "max_new_tokens": new_tokens, "temperature": 0,
               "ignore_eos": True} for _ in range(c)]
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(client.post(url, json=b) for b in bodies), return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = [r for r in rs if not isinstance(r, BaseException) and r.status_code == 200]
    return wall, sum(r.json()["usage"]["completion_tokens"] for r in ok), c - len(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packed", default="/tmp/coldstart-bench/packed")
    ap.add_argument("--engine", type=json.loads, default={}, help="args.engine, as JSON")
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[16, 64, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-gpus", type=float, default=1, help="0: check the script on a CPU machine")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    import ray
    from ray import serve

    from bench.serve import BASE, CONFIG_ENV, ENV, WARMUP
    from deployments.app import LLMDeployment
    packed = Path(a.packed)
    text = prompt_text(packed, a.prompt_len)
    ray.init(runtime_env={"env_vars": {**ENV, **CONFIG_ENV}}, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    most = max(a.concurrency)
    dep = LLMDeployment.options(ray_actor_options={"num_gpus": a.num_gpus, "num_cpus": 1}, user_config=WARMUP,
                                max_ongoing_requests=most + 8, max_queued_requests=most)
    res: dict = {"engine": a.engine, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "runs": {}}
    try:
        serve.run(dep.bind(model=str(packed), device="cuda" if a.num_gpus else "cpu", engine=a.engine),
                  name="tput", route_prefix="/tput")
        url = f"{BASE}/tput/generate"
        asyncio.run(burst(url, text, min(4, most), 8))  # the first requests' one-time costs, not timed
        for c in a.concurrency:
            runs = []
            for _ in range(a.rounds):
                wall, tokens, failed = asyncio.run(burst(url, text, c, a.new_tokens))
                runs.append({"wall_s": wall, "tokens": tokens, "failed": failed, "tokens_per_s": tokens / wall})
                print(f"  {c:4d} concurrent: {tokens / wall:9.1f} tokens/s ({tokens} tokens in {wall:.2f} s, "
                      f"{failed} failed)", flush=True)
            res["runs"][c] = runs
        import httpx
        res["replica_engine"] = httpx.get(f"{BASE}/tput/stats", timeout=30).json()["engine"]
    finally:
        serve.shutdown()
        ray.shutdown()
    res["summary"] = {f"tokens_per_s_c{c}": statistics.median(r["tokens_per_s"] for r in runs)
                      for c, runs in res["runs"].items()}
    res["command"] = "PYTHONPATH=$PWD python bench/throughput.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"throughput-{a.engine.get('kv_cache', 'static')}.json"
    (out / name).write_text(json.dumps(res, indent=2))
    print(json.dumps(res["summary"], indent=2))


if __name__ == "__main__":
    main()
