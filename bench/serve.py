"""Replica start as Ray Serve sees it: minimal vs coldstart vs a transformers-based replica.

Run on the GPU machine from the repository root, after bench/load.py made the
checkpoint (or with --hf / --packed pointing at one):

    PYTHONPATH=$PWD python bench/serve.py --out bench/results

For each deployment, alone on the GPU: deploy (serve.run, non-blocking), then
poll until the application is RUNNING (Ray routes only to replicas that passed
__init__, reconfigure and a first health check), then time the first 200
answer. The window starts when the controller is asked for the replica, so the
worker's process start and every import inside it are counted.

  minimal       __init__: import torch, create the CUDA context
  coldstart     deployments.app.LLMDeployment on the packed model (warm-up in reconfigure)
  transformers  __init__: import transformers, from_pretrained(device_map="cuda");
                reconfigure: one generate (512-token prompt, 16 new tokens)

Warm page cache first, then (after echo 3 > /proc/sys/vm/drop_caches) cold for
minimal and coldstart. Writes serve.json and serve.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENV = {"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


@serve.deployment(ray_actor_options={"num_gpus": 1, "num_cpus": 1})
class Minimal:
    def __init__(self):
        t0 = time.perf_counter()
        import torch
        t1 = time.perf_counter()
        if torch.cuda.is_available():  # (--num-gpus 0 checks this script on a CPU machine)
            torch.empty(1, device="cuda")
            torch.cuda.synchronize()
        self.phases = {"import_torch": t1 - t0, "context": time.perf_counter() - t1}

    async def __call__(self, request: Request):
        return JSONResponse({"phases": self.phases})


@serve.deployment(ray_actor_options={"num_gpus": 1, "num_cpus": 1}, user_config={})
class TransformersReplica:
    def __init__(self, path: str):
        t = time.perf_counter
        t0 = t()
        import torch
        t1 = t()
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        torch.empty(1, device=self.dev)
        t2 = t()
        from transformers import AutoModelForCausalLM
        t3 = t()
        self.model = AutoModelForCausalLM.from_pretrained(
            path, device_map=self.dev if self.dev == "cuda" else None, dtype=torch.float16 if self.dev == "cuda" else torch.float32)
        self.phases = {"import_torch": t1 - t0, "context": t2 - t1, "import_transformers": t3 - t2,
                       "load": t() - t3}

    def reconfigure(self, user_config):
        import torch
        t0 = time.perf_counter()
        ids = torch.randint(3, 500, (1, 512), device=self.dev)
        self.model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        if self.dev == "cuda":
            torch.cuda.synchronize()
        self.phases["first_generate"] = time.perf_counter() - t0

    async def __call__(self, request: Request):
        return JSONResponse({"phases": self.phases})


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def measure(name: str, app, url_path: str, body: dict | None) -> dict:
    t0 = time.perf_counter()
    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    while True:
        st = serve.status().applications.get(name)
        s = str(st.status).split(".")[-1] if st else None
        if s == "RUNNING":
            break
        if s == "DEPLOY_FAILED":
            raise RuntimeError(f"{name}: {next(iter(st.deployments.values())).message}")
        time.sleep(0.05)
    t_running = time.perf_counter() - t0
    url = f"http://127.0.0.1:8000/{name}{url_path}"
    r = httpx.post(url, json=body, timeout=300) if body is not None else httpx.get(url, timeout=300)
    t_200 = time.perf_counter() - t0
    r.raise_for_status()
    info = httpx.get(f"http://127.0.0.1:8000/{name}/stats", timeout=30).json() if name.startswith("coldstart") \
        else r.json()
    serve.delete(name)
    res = {"deploy_to_running_s": t_running, "deploy_to_first_200_s": t_200,
           "phases": info.get("phases") or info.get("startup_phases_s")}
    print(f"  {name:22s} RUNNING after {t_running:6.2f} s, first 200 after {t_200:6.2f} s  "
          f"phases {json.dumps({k: round(v, 3) for k, v in res['phases'].items()})}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default="/tmp/coldstart-bench/hf")
    ap.add_argument("--packed", default="/tmp/coldstart-bench/packed")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--num-gpus", type=float, default=1, help="0: check the script on a CPU machine")
    a = ap.parse_args()
    from deployments.app import LLMDeployment

    t0 = time.perf_counter()
    ray.init(runtime_env={"env_vars": ENV}, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    print(f"ray.init + serve.start: {time.perf_counter() - t0:.1f} s", flush=True)
    # a throwaway deploy so that every measured one finds Serve's proxy and controller up
    gpus = {"num_gpus": a.num_gpus, "num_cpus": 1}
    minimal = Minimal.options(ray_actor_options=gpus)
    hf_rep = TransformersReplica.options(ray_actor_options=gpus)
    measure("prime", minimal.bind(), "", {})

    def ours(tag: str):
        dep = LLMDeployment.options(ray_actor_options={"num_gpus": a.num_gpus, "num_cpus": 1},
                                    user_config={"warmup": {"requests": 1, "batch_sizes": [1, 4]}})
        app = dep.bind(model=a.packed, device="cuda" if a.num_gpus else "cpu",
                       engine={"max_slots": 16, "max_seq_len": 4096 if a.num_gpus else 1024}, load={})
        return measure(f"coldstart-{tag}", app, "/generate",
                       {"prompt": "The answer is ", "max_new_tokens": 16, "temperature": 0})

    res = {"warm": {}, "cold": {}}
    # warm means warm: the weights of both replicas in the page cache before they start
    for d in (Path(a.packed), Path(a.hf)):
        for f in sorted(d.iterdir()):
            if f.is_file():
                with open(f, "rb") as fh:
                    while fh.read(64 << 20):
                        pass
    print("warm page cache:", flush=True)
    res["warm"]["minimal"] = measure("minimal-warm", minimal.bind(), "", {})
    res["warm"]["coldstart"] = ours("warm")
    res["warm"]["transformers"] = measure("transformers-warm", hf_rep.bind(a.hf), "", {})
    if not a.skip_cold:
        print("cold page cache:", flush=True)
        drop_caches()
        res["cold"]["minimal"] = measure("minimal-cold", minimal.bind(), "", {})
        drop_caches()
        res["cold"]["coldstart"] = ours("cold")
    w = res["warm"]
    summary = {
        "minimal_warm_s": w["minimal"]["deploy_to_running_s"],
        "coldstart_warm_s": w["coldstart"]["deploy_to_running_s"],
        "transformers_warm_s": w["transformers"]["deploy_to_running_s"],
    }
    summary["coldstart_minus_minimal_warm_s"] = summary["coldstart_warm_s"] - summary["minimal_warm_s"]
    summary["coldstart_over_transformers_warm"] = summary["coldstart_warm_s"] / summary["transformers_warm_s"]
    if res["cold"]:
        summary["minimal_cold_s"] = res["cold"]["minimal"]["deploy_to_running_s"]
        summary["coldstart_cold_s"] = res["cold"]["coldstart"]["deploy_to_running_s"]
        summary["coldstart_minus_minimal_cold_s"] = summary["coldstart_cold_s"] - summary["minimal_cold_s"]
    summary["command"] = "PYTHONPATH=$PWD python bench/serve.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps({**summary, "detail": res}, indent=2))
    md = ["Deploy -> replica RUNNING (Ray routes to it) on one H200, each deployment alone.", "",
          "| replica | warm cache s | cold cache s |", "|---|---|---|"]
    for k in ("minimal", "coldstart", "transformers"):
        c = res["cold"].get(k, {}).get("deploy_to_running_s")
        md.append(f"| {k} | {w[k]['deploy_to_running_s']:.2f} | {'' if c is None else f'{c:.2f}'} |")
    md += ["", f"coldstart - minimal (warm): {summary['coldstart_minus_minimal_warm_s']:.2f} s; "
               f"coldstart / transformers (warm): {summary['coldstart_over_transformers_warm']:.2f}", "",
           f"Command: `{summary['command']}`", ""]
    (out / "serve.md").write_text("\n".join(md))
    print("\n".join(md))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
