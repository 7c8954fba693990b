"""The cold-start report: a replica's start as Ray reports it, side by side, in Ray Serve.

Run on the GPU machine from the repository root (makes the 7B random checkpoint
and packs it under --work if bench/load.py has not, or give --hf and --packed):

    PYTHONPATH=$PWD python bench/serve.py --out bench/work --report docs

For each replica kind, deployed alone on the GPU: deploy (serve.run,
non-blocking), poll until the application is RUNNING (Ray routes only to
replicas that passed __init__, reconfigure and a first health check), then time
the first 200 answer. Each start is judged from the controller adding the
replica (its start_time_s) to the controller marking it RUNNING (its log line),
the window Ray reports as the replica's startup latency: the worker's process
start and every import inside it count. Deploy -> warm (the serve.run call to
the replica's own clock at the end of reconfigure) is recorded beside it.

  minimal       __init__: import torch, create the CUDA context (the floor)
  minimal-cached  the same, after turning on the per-node bytecode cache a coldstart replica
                uses where the interpreter keeps no .pyc of its own (deployments.bytecode):
                the floor for a replica that compiles none of torch's modules either
  minimal-early  minimal-cached with serve_config.yaml's worker setup hook importing torch
                (deployments.early, COLDSTART_EARLY_IMPORT=torch): the floor for a replica that
                imports torch beside Ray's start of its worker too (the hook pauses its
                garbage collector as well, for good: the minimal replica never resumes it)
  coldstart     deployments.app.LLMDeployment on the packed model (warm-up in reconfigure),
                with serve_config.yaml's runtime_env env vars, as `serve run` deploys it
  coldstart-late  the same without the setup hook's imports (COLDSTART_EARLY_IMPORT=0)
  transformers  __init__: import transformers, from_pretrained(device_map="cuda");
                reconfigure: one generate (512-token prompt, 16 new tokens)
  transformers-cached  the same with the bytecode cache (see minimal-cached)
  *-worker-cached  minimal, coldstart, transformers with the bytecode cache set for the whole
                worker process (PYTHONPYCACHEPREFIX in the deployment's runtime_env, the option
                serve_config.yaml documents): Ray's own modules are read compiled too
  naive         (--naive) the article's "before": random init on the CPU,
                load_state_dict from the safetensors shards, .half().cuda()

Each kind runs with a warm page cache (its files read just before) and a cold
one (echo 3 > /proc/sys/vm/drop_caches first); minimal and coldstart are
deployed `--repeat` times per cache (3), interleaved, and the median counts.
Every coldstart start is asked the same greedy question; the report says whether
all of them gave the same tokens (a start that serves wrong ones does not count).
`--kinds` and `--caches` pick some of them; `--merge WORK/serve-partial.json`
adds them to an earlier run on the same machine (the naive path takes minutes
per start: `SERVE_EXTRA="--naive --kinds naive" bash bench/gpu.sh OUT serve`);
`--from-partial` writes the report of a run that was cut short. Writes serve.json / serve.md
into --out and, with --report DIR, coldstart-report.{json,md,png} into DIR
(the PNG needs matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
import yaml
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.load import ensure_checkpoint, warm_cache  # noqa: E402
from bench.load import run as run_limit  # noqa: E402
from bench.serve_report import REPEATED, _ours_phases, finish, median_run, total  # noqa: E402
from deployments.startup import bytecode, early  # noqa: E402
ENV = {"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
       # Triton's kernel cache: the deployments find the 7B's kernels there, as on a node that ran
       # the model before (a new node compiles them once: `bash bench/gpu.sh OUT fresh-node` times it)
       **({"TRITON_CACHE_DIR": os.environ["TRITON_CACHE_DIR"]} if "TRITON_CACHE_DIR" in os.environ else {})}
# the worker-wide bytecode cache (serve_config.yaml's commented option): the same directory a
# replica keeps its own in (deployments.bytecode, from the same TRITON_CACHE_DIR as ENV's), so
# what one primes the other finds
WORKER_PYC = {"PYTHONPYCACHEPREFIX": bytecode.cache_dir() or os.path.join(tempfile.gettempdir(), bytecode.SUBDIR),
              "PYTHONDONTWRITEBYTECODE": ""}
BASE = "http://127.0.0.1:8000"
# the warm-up plan users run: serve_config.yaml's user_config
_APP = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
WARMUP = next(d["user_config"] for d in _APP["deployments"] if d["name"] == "LLMDeployment")
# and its runtime_env's env vars (the worker setup hook among them: deployments.early), which
# every coldstart replica of the run gets, as `serve run serve_config.yaml` gives them
CONFIG_ENV = {k: str(v) for k, v in ((_APP.get("runtime_env") or {}).get("env_vars") or {}).items()}
# minimal-early: the minimal replica with the same hook, importing torch alone
EARLY_TORCH = {early.ENV_VAR: early.HOOK, "COLDSTART_EARLY_IMPORT": "torch"}


def _dev() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --num-gpus 0 checks the script


@serve.deployment
class Minimal:
    def __init__(self, bytecode_cache: bool = False):
        self.constructor_started_at = time.time()
        t0 = time.perf_counter()
        if bytecode_cache:
            from deployments.startup import bytecode
            bytecode.enable()
        import torch
        t1 = time.perf_counter()
        torch.empty(1, device=_dev())
        self.phases = {"imports": t1 - t0, "context": time.perf_counter() - t1}
        self.warm_at = time.time()  # no reconfigure: ready when the constructor returns

    async def __call__(self, request: Request):
        from deployments.startup import early
        from deployments.device import process_start_time
        return JSONResponse({"phases": self.phases, "warm_at": self.warm_at,
                             "constructor_started_at": self.constructor_started_at,
                             "process_started_at": process_start_time(), "early_import": early.times()})


@serve.deployment(user_config={})
class TransformersReplica:
    def __init__(self, path: str, naive: bool = False, bytecode_cache: bool = False):
        t = time.perf_counter
        t0 = t()
        if bytecode_cache:
            from deployments.startup import bytecode
            bytecode.enable()
        import torch
        t1 = t()
        self.dev = _dev()
        torch.empty(1, device=self.dev)
        t2 = t()
        from transformers import AutoConfig, AutoModelForCausalLM
        t3 = t()
        self.phases = {"imports": t1 - t0 + t3 - t2, "context": t2 - t1}
        if naive:  # the article's "before": random init, load_state_dict, .half().cuda()
            from safetensors.torch import load_file
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
            for f in sorted(Path(path).glob("*.safetensors")):
                model.load_state_dict(load_file(str(f)), strict=False)
            self.model = (model.half() if self.dev == "cuda" else model).to(self.dev)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                path, device_map=self.dev if self.dev == "cuda" else None,
                dtype=torch.float16 if self.dev == "cuda" else torch.float32)
        if self.dev == "cuda":
            torch.cuda.synchronize()
        self.phases["load"] = t() - t3

    def reconfigure(self, user_config):
        import torch
        t0 = time.perf_counter()
        ids = torch.randint(3, 500, (1, 512), device=self.dev)
        self.model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        if self.dev == "cuda":
            torch.cuda.synchronize()
        self.phases["warmup"] = time.perf_counter() - t0
        self.warm_at = time.time()

    async def __call__(self, request: Request):
        from deployments.device import process_start_time
        return JSONResponse({"phases": self.phases, "warm_at": self.warm_at,
                             "process_started_at": process_start_time()})


def fresh_node() -> None:
    """As on a node that never ran the model: Triton's cache emptied (coldstart's kernel verdicts and
    bytecode cache live in it too), the project's written bytecode removed, the page cache dropped."""
    import shutil
    cache = Path(ENV.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    shutil.rmtree(cache, ignore_errors=True)
    for d in [*ROOT.glob("deployments/**/__pycache__"), *ROOT.glob("weights/**/__pycache__"),
              *ROOT.glob("deployments/__pycache__"), *ROOT.glob("weights/__pycache__")]:
        shutil.rmtree(d, ignore_errors=True)
    drop_caches()


def without_kernels(packed: Path) -> Path:
    """A copy of the packed model without its shipped kernels: its files linked, not copied."""
    bare = packed.with_name(packed.name + "-nokernels")
    bare.mkdir(exist_ok=True)
    for f in packed.iterdir():
        if f.is_file() and not (bare / f.name).exists():
            os.link(f, bare / f.name)
    return bare


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


_STARTED = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) controller \d+ -- "
                      r"Replica\(id='(?P<id>[^']+)', deployment='[^']*', app='(?P<app>[^']*)'\) "
                      r"started successfully .*? after (?P<e2e>[\d.]+)s")


def controller_running_at(logs: Path, app: str, replica_id: str, timeout: float = 10) -> tuple[float, float] | None:
    """(Unix time, logged seconds) of the controller's line saying ``replica_id`` of ``app``
    started: it writes it as it marks the replica RUNNING, with the seconds since it added the
    replica (what it also exports as serve_replica_startup_latency_ms), to 0.1 s; the line's
    own time is to the millisecond. None where no such line came within ``timeout``."""
    deadline = time.time() + timeout
    while True:
        for f in sorted(logs.glob("controller_*.log")):
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    m = _STARTED.match(line)
                    if m and m["id"] == replica_id and m["app"] == app:
                        at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                        return at, float(m["e2e"])
        if time.time() > deadline:
            return None
        time.sleep(0.1)


def ray_view(name: str) -> dict:
    """Ray's own account of application ``name``'s one replica's start: when the controller
    added it (the replica's ``start_time_s``: its scheduling request made, before the worker's
    process is asked for) and when the controller marked it RUNNING (after the constructor,
    ``reconfigure``, Ray's own ``gc.collect()`` and the first health check)."""
    from ray.serve.context import _get_global_client
    details = _get_global_client().get_serve_details()
    reps = [r for dep in details["applications"][name]["deployments"].values() for r in dep["replicas"]]
    if len(reps) != 1:
        raise RuntimeError(f"{name}: {len(reps)} replicas, expected one")
    rep = reps[0]
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    seen = controller_running_at(logs, name, rep["replica_id"])
    out = {"replica_id": rep["replica_id"], "added_at": rep["start_time_s"]}
    if seen is not None:
        out["running_at"], out["logged_s"] = seen
    return out


def measure(name: str, app, url_path: str, body: dict | None) -> dict:
    t0 = time.perf_counter()
    deployed_at = time.time()
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
    url = f"{BASE}/{name}{url_path}"
    r = httpx.post(url, json=body, timeout=300) if body is not None else httpx.get(url, timeout=300)
    t_200 = time.perf_counter() - t0
    r.raise_for_status()
    ours = name.startswith("coldstart")
    info = httpx.get(f"{BASE}/{name}/stats", timeout=30).json() if ours else r.json()
    seen = ray_view(name)
    serve.delete(name)
    phases = info.get("phases") or _ours_phases(info["startup_phases_s"])
    # deploy -> warm from the replica's own clock (same host): precise, where the polled
    # RUNNING status moves in steps of the controller's loop
    warm = info["warm_at"] - deployed_at
    born = info.get("process_started_at")
    res = {"deploy_to_warm_s": warm, "deploy_to_running_s": t_running, "deploy_to_first_200_s": t_200,
           "process_to_warm_s": None if born is None else info["warm_at"] - max(born, deployed_at),
           "phases": phases, "detail": info.get("startup_phases_s"),
           # the window Ray reports: from the controller adding the replica to its RUNNING
           "added_after_deploy_s": seen["added_at"] - deployed_at}
    zero = seen["added_at"]
    timed = sum(phases.values())  # what the replica timed itself, up to warm
    if "running_at" in seen:
        res["start_to_running_s"] = seen["running_at"] - zero
        res["ray_logged_startup_s"] = seen["logged_s"]  # the controller's own figure, to 0.1 s
        # after the replica was warm: Ray's gc.collect(), the first health check, the controller's loop
        res["phases"]["ready"] = max(0.0, seen["running_at"] - info["warm_at"])
    else:
        print(f"  {name}: the controller's log has no start line for replica {seen['replica_id']}: "
              "judged on deploy -> warm", flush=True)
        zero = deployed_at
    if ours:  # what the replica answered (the report checks that every start agrees)
        res["answer"] = r.json()["token_ids"]
        res["engine"] = info.get("engine")  # its start's graphs, first launches and first prefills
        res["gc"] = info.get("gc")
    # what the replica did not time itself: Ray scheduling, the worker's start
    res["phases"]["ray_and_process"] = max(0.0, info["warm_at"] - zero - timed)
    # and of that, the part before the constructor began, split where the replica's process
    # first imported the project (coldstart only: unpickling the deployment's class); from the
    # same zero as the figure
    if info.get("constructor_started_at"):
        res["to_constructor_s"] = info["constructor_started_at"] - zero
        if info.get("imported_at"):
            res["to_project_import_s"] = info["imported_at"] - zero
    if info.get("early_import"):  # the worker setup hook (deployments.early): when, and each import done
        res["early_import_s"] = {k.removesuffix("_at"): round(v - zero, 3) if k.endswith("_at") else v
                                 for k, v in info["early_import"].items()}
    print(f"  {name:22s} added->RUNNING {res.get('start_to_running_s', float('nan')):6.2f} s "
          f"(Ray logged {res.get('ray_logged_startup_s', float('nan')):.1f}), deploy->warm {warm:6.2f} s, "
          f"first 200 after {t_200:6.2f} s, constructor after {res.get('to_constructor_s', float('nan')):5.2f} s  "
          f"phases {json.dumps({k: round(v, 3) for k, v in res['phases'].items()})}", flush=True)
    return res


# deployed --repeat times per cache (the +2 s goal compares these two); the others once
def scale_up(packed: Path, num_gpus: float, device: str, seconds: float = 120) -> dict:
    """1 -> 2 replicas under load (needs 2 GPUs): from the scale decision (Ray shows a
    second replica STARTING) until the new replica answers a request."""
    import concurrent.futures as cf
    from deployments.app import LLMDeployment
    name = "scaleup"
    dep = LLMDeployment.options(
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": 1}, max_ongoing_requests=16,
        user_config=WARMUP,
        autoscaling_config={"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                            "target_ongoing_requests": 2, "upscale_delay_s": 1,
                            "downscale_delay_s": 600, "metrics_interval_s": 0.5,
                            "look_back_period_s": 2})
    app = dep.bind(model=str(packed), device=device, engine={"max_slots": 16, "max_seq_len": 1024})
    serve.run(app, name=name, route_prefix=f"/{name}")
    first = httpx.post(f"{BASE}/{name}/generate", json={"prompt": "a", "max_new_tokens": 1},
                       timeout=60).headers["x-coldstart-replica"]
    stop = time.time() + seconds
    seen: dict[str, float] = {}
    decided: list[float] = []

    def load() -> None:
        while time.time() < stop and not seen:
            r = httpx.post(f"{BASE}/{name}/generate", timeout=120, json={
                "prompt": "go", "max_new_tokens": 256, "ignore_eos": True, "temperature": 0})
            rid = r.headers.get("x-coldstart-replica")
            if rid and rid != first and rid not in seen:
                seen[rid] = time.time()

    with cf.ThreadPoolExecutor(12) as pool:
        futs = [pool.submit(load) for _ in range(12)]
        while time.time() < stop and not seen:
            states = next(iter(serve.status().applications[name].deployments.values())).replica_states
            if not decided and sum(states.values()) >= 2:
                decided.append(time.time())
            time.sleep(0.05)
        for f in futs:
            f.result()
    serve.delete(name)
    if not decided or not seen:
        raise RuntimeError("no scale-up observed: raise the load or the time limit")
    t = next(iter(seen.values())) - decided[0]
    print(f"  scale-up: second replica served {t:.2f} s after the scale decision", flush=True)
    return {"decision_to_first_answer_s": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/coldstart-bench",
                    help="where the 7B checkpoint is made (if absent) and packed")
    ap.add_argument("--hf", help="an HF checkpoint directory instead (default: WORK/hf)")
    ap.add_argument("--packed", help="its packed copy (default: WORK/packed)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "work"))
    ap.add_argument("--report", help="also write coldstart-report.{json,md,png} into this folder")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--naive", action="store_true", help="add the article's naive path (minutes)")
    ap.add_argument("--num-gpus", type=float, default=1, help="0: check the script on a CPU machine")
    ap.add_argument("--kinds", type=lambda v: [k for k in v.split(",") if k],
                    help="only these replica kinds (comma list: minimal,minimal-cached,coldstart,transformers,transformers-cached,naive)")
    ap.add_argument("--merge", metavar="JSON",
                    help="add to an earlier run's serve-partial.json (same machine) instead of starting afresh")
    ap.add_argument("--from-partial", metavar="JSON",
                    help="write serve.json/md (and --report) from a cut-short run's serve-partial.json")
    ap.add_argument("--repeat", type=int, default=3,
                    help="deploys of minimal and coldstart per cache, interleaved; the median counts "
                         "(one start is at the mercy of a shared host: imports alone moved by 1 s)")
    ap.add_argument("--caches", type=lambda v: [c for c in v.split(",") if c], default=["warm", "cold"],
                    help="which page-cache states to measure (warm,cold); the naive path's minutes-long "
                         "starts fit one device call each: --kinds naive --caches cold")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help='also deploy coldstart with other settings, as kind coldstart-NAME (repeated like '
                         'coldstart): JSON {"engine": {...}, "load": {...}, "env": {VAR: value}}, e.g. '
                         'notriton=\'{"env": {"COLDSTART_TRITON": "0"}}\'; what each start step costs, in Ray')
    ap.add_argument("--scale-up-only", action="store_true", help="only the scale-up figure (2 GPUs)")
    ap.add_argument("--scale-up", action="store_true",
                    help="also time a 1 -> 2 replica scale-up under load (needs 2 GPUs)")
    a = ap.parse_args()
    if a.repeat < 1 or not set(a.caches) <= {"warm", "cold", "fresh"} or not a.caches:
        ap.error("--repeat must be >= 1 and --caches a comma list of warm, cold, fresh")
    variants = []  # checked here, before a checkpoint is made or Ray started
    for spec in a.variant:
        name, _, js = spec.partition("=")
        try:
            v = json.loads(js)
        except ValueError:
            v = None
        if not (name.isidentifier() and isinstance(v, dict) and set(v) <= {"engine", "load", "env"}
                and all(isinstance(x, str) for x in (v.get("env") or {}).values())):
            ap.error(f"--variant {spec!r}: want NAME=JSON, JSON an object with engine, load and env "
                     "(env values strings)")
        variants.append({**v, "name": name})
    if a.from_partial:
        res = json.loads(Path(a.from_partial).read_text())
        command = res.pop("command", None) or f"PYTHONPATH=$PWD python bench/serve.py (cut short; {a.from_partial})"
        finish(res, a.out, a.report, command)
        return
    from deployments.app import LLMDeployment

    if a.hf and a.packed:
        hf, packed = Path(a.hf), Path(a.packed)
    else:
        hf, packed, prep = ensure_checkpoint(Path(a.work), "llama-7b")
        print(f"prepared {prep}", flush=True)
    t0 = time.perf_counter()
    ray.init(runtime_env={"env_vars": ENV}, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    print(f"ray.init + serve.start: {time.perf_counter() - t0:.1f} s", flush=True)
    gpus = {"num_gpus": a.num_gpus, "num_cpus": 1}
    minimal = Minimal.options(ray_actor_options=gpus)
    hf_rep = TransformersReplica.options(ray_actor_options=gpus)
    worker_cached = {**gpus, "runtime_env": {"env_vars": {**ENV, **WORKER_PYC}}}
    minimal_w = Minimal.options(ray_actor_options=worker_cached)
    minimal_e = Minimal.options(ray_actor_options={**gpus, "runtime_env": {"env_vars": {**ENV, **EARLY_TORCH}}})
    hf_rep_w = TransformersReplica.options(ray_actor_options=worker_cached)
    # a throwaway deploy, so every measured one finds Serve's proxy and controller up, and the
    # per-node bytecode cache holds torch's modules where replicas keep one (deployments.bytecode),
    # as on a node that has run a replica before (the first replica on a node compiles them)
    measure("prime", minimal.bind(True), "", {})

    def ours(tag: str, variant: dict | None = None, model: Path | None = None) -> dict:
        v = variant or {}
        # as `coldstart serve --model` and serve_config.gpu.yaml set it: the setup hook reads the
        # weights early where they are not cached (a variant's env may set it empty: off)
        env = {**CONFIG_ENV, "COLDSTART_EARLY_WEIGHTS": str(model or packed), **(v.get("env") or {})}
        opts = {**gpus, "runtime_env": {"env_vars": {**ENV, **env}}}
        dep = LLMDeployment.options(ray_actor_options=opts, user_config=WARMUP)
        app = dep.bind(model=str(model or packed), device="cuda" if a.num_gpus else "cpu",
                       engine={"max_slots": 16, "max_seq_len": 4096 if a.num_gpus else 1024,
                               **(v.get("engine") or {})},
                       load=v.get("load") or {})
        return measure(f"coldstart-{tag}" if variant is None else f"coldstart-{tag}-{v['name']}", app,
                       "/generate", {"prompt": "The answer is ", "max_new_tokens": 16, "temperature": 0})

    kinds = {"minimal": lambda tag: measure(f"minimal-{tag}", minimal.bind(), "", {}),
             "minimal-cached": lambda tag: measure(f"minimal-cached-{tag}", minimal.bind(True), "", {}),
             "minimal-early": lambda tag: measure(f"minimal-early-{tag}", minimal_e.bind(True), "", {}),
             "coldstart": ours,
             "coldstart-late": lambda tag: ours(tag, {"name": "late", "env": {"COLDSTART_EARLY_IMPORT": "0"}}),
             "coldstart-nokernels": lambda tag: ours(tag, {"name": "nokernels"}, model=without_kernels(packed)),
             "transformers": lambda tag: measure(f"transformers-{tag}", hf_rep.bind(str(hf)), "", {}),
             "transformers-cached": lambda tag: measure(f"transformers-cached-{tag}",
                                                        hf_rep.bind(str(hf), False, True), "", {}),
             "minimal-worker-cached": lambda tag: measure(f"minimal-worker-cached-{tag}", minimal_w.bind(), "", {}),
             "coldstart-worker-cached": lambda tag: ours(tag, {"name": "worker-cached", "env": WORKER_PYC}),
             "transformers-worker-cached": lambda tag: measure(f"transformers-worker-cached-{tag}",
                                                               hf_rep_w.bind(str(hf)), "", {})}
    for v in variants:
        kinds[f"coldstart-{v['name']}"] = lambda tag, v=v: ours(tag, v)
    if a.scale_up_only:  # the 1 -> 2 replica figure alone
        kinds, a.scale_up, a.skip_cold = {}, True, True
    if a.naive:
        # Ray gives a 1-CPU actor one torch thread: random init of 7B on one core takes
        # minutes, which no one would deploy; give the naive path the cores it would have
        cpus = max(1, min(16, (os.cpu_count() or 2) // 2)) if a.num_gpus else 1
        naive = TransformersReplica.options(ray_actor_options={**gpus, "num_cpus": cpus})
        kinds["naive"] = lambda tag: measure(f"naive-{tag}", naive.bind(str(hf), True), "", {})
    if a.kinds:
        unknown = set(a.kinds) - set(kinds)
        if unknown:
            ap.error(f"--kinds: unknown {sorted(unknown)} (known: {', '.join(kinds)}; naive needs --naive)")
        asked = set(a.kinds) | {f"coldstart-{v['name']}" for v in variants}  # (and the variants)
        kinds = {k: v for k, v in kinds.items() if k in asked}
    if any(k.startswith("coldstart") for k in kinds) and not a.merge:
        # Triton's kernel cache (ENV's TRITON_CACHE_DIR) holds the 7B's kernels before coldstart is
        # measured, as on a node that ran the model before; a new node's first replica compiles
        # them, which the fresh-node stage measures on its own (docs/measurements.md)
        ours("prime")
    if "transformers-cached" in kinds and not a.merge:  # its modules in the bytecode cache before it is measured
        measure("prime-transformers", hf_rep.bind(str(hf), False, True), "", {})
    if any(k.endswith("worker-cached") for k in kinds) and not a.merge:  # and Ray's, for the worker-wide cache
        measure("prime-worker", (hf_rep_w.bind(str(hf)) if "transformers-worker-cached" in kinds
                                 else minimal_w.bind()), "", {})
    res: dict = {"warm": {}, "cold": {}, "fresh": {}}
    command = "PYTHONPATH=$PWD python bench/serve.py " + " ".join(sys.argv[1:])
    if a.merge:  # an earlier run on this machine (its disk figure and command stay with it)
        prev = json.loads(Path(a.merge).read_text())
        res = {**prev, **{c: dict(prev.get(c, {})) for c in ("warm", "cold", "fresh")}}
        command = f"{prev.get('command', a.merge)}; then {command}"
    if "fresh" in a.caches and a.num_gpus and not (packed / "kernels").is_dir():
        # the kernels a new node's replica finds shipped with the model (`coldstart kernels`)
        import subprocess
        subprocess.run([sys.executable, "-m", "deployments.tools.cli", "kernels", str(packed), "--max-slots", "16",
                        "--max-seq-len", "4096"], cwd=ROOT, check=True)
    if kinds and not a.skip_cold and a.num_gpus and "disk" not in res:
        # the cold goal is minimal + the disk's time for the weights, both from this run
        res["disk"] = run_limit("disk", str(packed), "16", cold=True)
    for cache in [c for c in a.caches if c == "warm" or not a.skip_cold]:
        print(f"{cache} page cache:" if cache != "fresh" else "fresh node (every cache emptied):", flush=True)
        runs: dict[str, list[dict]] = {}
        for rep in range(a.repeat):  # interleaved, so that a slow minute of the host hits every kind
            for kind, run in kinds.items():
                if rep and kind not in REPEATED and not kind.startswith("coldstart-"):
                    continue
                if cache == "warm":
                    warm_cache(packed)  # warm means the weights are in the page cache
                    warm_cache(hf)
                elif cache == "fresh":
                    fresh_node()
                else:
                    drop_caches()
                runs.setdefault(kind, []).append(run(cache))
                if "answer" in runs[kind][-1]:
                    res.setdefault("answers", []).append({"kind": kind, "cache": cache,
                                                          "token_ids": runs[kind][-1]["answer"]})
                res[cache][kind] = median_run(runs[kind])
                if len(runs[kind]) > 1:
                    res.setdefault(f"{cache}_runs_s", {})[kind] = [total(r) for r in runs[kind]]
                # a run cut short (a time limit) still leaves what it measured; a later run
                # on the same machine can add to it (--merge WORK/serve-partial.json)
                for d in (Path(a.out), Path(a.work)):
                    d.mkdir(parents=True, exist_ok=True)
                    (d / "serve-partial.json").write_text(json.dumps({**res, "command": command}, indent=2))

    if a.scale_up:
        warm_cache(packed)
        res["scale_up"] = scale_up(packed, a.num_gpus, "cuda" if a.num_gpus else "cpu")
    finish(res, a.out, a.report, command)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
