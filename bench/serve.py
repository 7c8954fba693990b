"""The cold-start report: a replica's start as Ray reports it, side by side, in Ray Serve.

Run on the GPU machine from the repository root (makes the 7B random checkpoint
and packs it under --work if bench/load.py has not, or give --hf and --packed):

    PYTHONPATH=$PWD python bench/serve.py --out bench/results --report docs

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
per start: `bash bench/gpu.sh OUT serve naive-warm naive-cold`);
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
import statistics
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
from deployments.startup import bytecode, early  # noqa: E402
ENV = {"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
       # Triton's kernel cache: the deployments find the 7B's kernels there, as on a node that ran
       # the model before (a new node compiles them once: `bash bench/gpu.sh OUT startenv` times it)
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


def total(r: dict) -> float:
    """The figure every goal is judged on: the replica's start as Ray reports it
    (``start_to_running_s``: from the controller adding the replica to the controller marking it
    RUNNING). Runs made before it was recorded (carried ones: the naive path) give deploy ->
    warm instead, from the serve.run call to the end of reconfigure, on the replica's clock."""
    return r.get("start_to_running_s", r["deploy_to_warm_s"])


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
        res["early_import_s"] = {k.removesuffix("_at"): round(v - zero, 3)
                                 for k, v in info["early_import"].items()}
    print(f"  {name:22s} added->RUNNING {res.get('start_to_running_s', float('nan')):6.2f} s "
          f"(Ray logged {res.get('ray_logged_startup_s', float('nan')):.1f}), deploy->warm {warm:6.2f} s, "
          f"first 200 after {t_200:6.2f} s, constructor after {res.get('to_constructor_s', float('nan')):5.2f} s  "
          f"phases {json.dumps({k: round(v, 3) for k, v in res['phases'].items()})}", flush=True)
    return res


# deployed --repeat times per cache (the +2 s goal compares these two); the others once
REPEATED = ("minimal", "minimal-cached", "minimal-early", "minimal-worker-cached", "coldstart")
# the goals: coldstart (as deployed, and with the worker-wide cache) against each floor
MINUS = (("coldstart", "minimal", "goal: + 2 s or less"),
         ("coldstart", "minimal-cached", "the same goal against a floor that compiles none of torch's modules either"),
         ("coldstart", "minimal-early",
          "the same goal against a floor that imports torch from the same worker setup hook"),
         ("coldstart-worker-cached", "minimal-worker-cached",
          "the same goal, both with the bytecode cache for the whole worker process"))
OVER = (("coldstart", "transformers", "goal: 1/3 or less"),
        ("coldstart", "transformers-cached",
         "the same goal against a transformers replica that compiles none of its modules either"),
        ("coldstart-worker-cached", "transformers",
         "the same goal with the worker-wide bytecode cache for coldstart only, as an operator would set it"),
        ("coldstart-worker-cached", "transformers-worker-cached",
         "the same goal, both with the worker-wide bytecode cache"))
# replicas whose engine computes as the default one does: their answers must all agree
SAME_ANSWER = ("coldstart", "coldstart-late", "coldstart-worker-cached", "coldstart-nokernels")


def _key(*parts: str) -> str:
    return "_".join(parts).replace("-", "_")


def paired(runs_s: dict[str, list[float]], ours: str, floor: str) -> list[float] | None:
    """``ours`` - ``floor`` in each round of the run (the kinds are deployed in turn, round after
    round), where both were deployed in at least three rounds: a host that slows down or speeds
    up over the run (Ray's worker start drifted by 2 s within one) shifts both alike, where the
    difference of the two medians mixes rounds."""
    a, b = runs_s.get(ours), runs_s.get(floor)
    if not a or not b or len(a) != len(b) or len(a) < 3:
        return None
    return [x - y for x, y in zip(a, b)]


def median_run(runs: list[dict]) -> dict:
    """The run with the median deploy -> warm time (the lower middle one of an even count)."""
    return sorted(runs, key=total)[(len(runs) - 1) // 2]


def _ours_phases(p: dict) -> dict:
    """coldstart's critical path: when the engine was built beside the load (load_wait
    recorded), its load share is what the main thread spent on the load: starting it (open,
    alloc, assemble: the buffer and its views, before the build) and waiting for the part the
    build did not hide. The load's whole time stays in the detail."""
    load = (p["load_wait"] + sum(p.get(k, 0.0) for k in ("open", "alloc", "assemble"))
            if "load_wait" in p else p["load"])
    return {"imports": p["imports"], "context": p["context"], "engine": p["engine"], "load": load,
            "warmup": p["warmup"]}


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


def goal_lines(s: dict) -> list[str]:
    """The deployment's start-up goals, each with the figures of this run."""
    lines = []
    for ours, floor, goal in MINUS:
        d = s.get(_key(ours, "minus", floor, "warm", "s"))
        if d is not None:
            lines.append(f"- warm: {ours} = {floor} {'+' if d >= 0 else '-'} {abs(d):.2f} s "
                         f"({goal}: {'met' if d <= 2 else 'not met'})")
    for ours, floor, _ in MINUS:
        d = s.get(_key(ours, "minus", floor, "warm", "rounds", "s"))
        if d:
            m = statistics.median(d)
            lines.append(f"- warm, round by round: {ours} - {floor} = "
                         + ", ".join(f"{x:+.2f}" for x in d) + f" s; median {m:+.2f} s "
                         f"({'within' if m <= 2 else 'over'} the + 2 s goal)")
    for cache in ("warm", "cold"):
        for kind, d in s.get(f"variants_minus_coldstart_{cache}_rounds_s", {}).items():
            lines.append(f"- {cache}, round by round: {kind} - coldstart = " + ", ".join(f"{x:+.2f}" for x in d)
                         + f" s; median {statistics.median(d):+.2f} s (a variant against the default)")
    for ours, floor, goal in OVER:
        r = s.get(_key(ours, "over", floor, "warm"))
        if r is not None:
            lines.append(f"- warm: {ours} = {r:.2f} of {floor} ({goal}: {'met' if r <= 1 / 3 else 'not met'})")
    if "cold_goal_s" in s and "coldstart_cold_s" in s:
        c, g = s["coldstart_cold_s"], s["cold_goal_s"]
        lines.append(f"- cold: coldstart {c:.2f} s vs minimal + the disk's time for the weights "
                     f"({s['disk_read_s']:.2f} s at {s['disk_GBps']:.2f} GB/s) = {g:.2f} s: "
                     f"{'met' if c <= g else 'not met'}")
    if "cold_goal_cached_s" in s and "coldstart_cold_s" in s:
        c, g = s["coldstart_cold_s"], s["cold_goal_cached_s"]
        lines.append(f"- cold: coldstart {c:.2f} s vs minimal-cached + the disk's time = {g:.2f} s: "
                     f"{'met' if c <= g else 'not met'}")
    if "fresh_node_goal_s" in s and "fresh_node_s" in s:
        c, g = s["fresh_node_s"], s["fresh_node_goal_s"]
        lines.append(f"- new node: coldstart {c:.2f} s vs minimal on the same fresh node + the disk's time + 1 s "
                     f"= {g:.2f} s: {'met' if c <= g else 'not met'}"
                     + (f"; without the shipped kernels {s['fresh_node_no_kernels_s']:.2f} s"
                        if "fresh_node_no_kernels_s" in s else ""))
    if "answers_agree" in s:
        lines.append(f"- every coldstart replica of the run ({s['answers']} starts) gave the same "
                     "greedy answer: " + ("yes" if s["answers_agree"] else
                                          "NO: a replica served wrong tokens, and its time does not count"))
    return lines


def write_report(res: dict, out: Path, command: str) -> None:
    """coldstart-report.{json,md,png}: the table and a stacked bar per run."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "coldstart-report.json").write_text(json.dumps({"command": command, **res}, indent=2))
    order = ["ray_and_process", "imports", "context", "engine", "load", "warmup", "ready"]
    rows = ["| replica | cache | added -> RUNNING s (Ray) | deploy -> warm s | first 200 s after deploy | "
            + " | ".join(f"{k} %" for k in order) + " |", "|---" * (5 + len(order)) + "|"]
    runs = [(kind, cache, r) for cache in ("warm", "cold") for kind, r in res.get(cache, {}).items()]
    for kind, cache, r in runs:
        tot = total(r)
        shares = [f"{100 * r['phases'].get(k, 0) / tot:.0f}" for k in order]
        ray_s = f"{r['start_to_running_s']:.2f}" if "start_to_running_s" in r else "not recorded"
        rows.append(f"| {kind}{' *' if r.get('measured_in') else ''} | {cache} | {ray_s} | "
                    f"{r['deploy_to_warm_s']:.2f} | "
                    f"{r['deploy_to_first_200_s']:.2f} | "
                    + " | ".join(shares) + " |")
    notes = []
    if any(kind == "coldstart" and "load_wait" in (r.get("detail") or {}) for kind, _, r in runs):
        notes.append("coldstart builds its engine while the weights load: its load share is the main "
                     "thread's time on the load, starting it (the device buffer and its views) and waiting "
                     "for what the build did not hide (the load's whole time is `detail.load` in the "
                     "JSON).\n\n")
    if any(kind == "naive" for kind, _, _ in runs):
        notes.append("naive: its load phase is the article's path, random init on the CPU + `load_state_dict` "
                     "from the shards + `.half().cuda()`.\n\n")
    for kind, cache, r in runs:
        if r.get("measured_in"):
            notes.append(f"\\* {kind}, {cache} cache: from another run ({r['measured_in']})"
                         + ("" if "start_to_running_s" in r else ", deploy -> warm") + ".\n\n")
    missing = [k for k in res.get("warm", {}) if res.get("cold") and k not in res["cold"]]
    if missing:
        notes.append(f"Not measured with a cold cache in this run: {', '.join(missing)}.\n\n")
    (out / "coldstart-report.md").write_text(
        "Replica start in Ray Serve, each replica alone on the GPU: from the controller adding "
        "the replica to the controller marking it RUNNING, as Ray reports a replica's startup "
        "(the goals are judged on it); beside it, from the serve.run call to the replica warm on "
        "its own clock, and to the first 200 answer. Phase shares of the first (ready: after "
        "reconfigure, Ray's gc.collect(), the first health check and the controller's loop; "
        "runs without Ray's figure: of deploy -> warm).\n\n"
        + "\n".join(rows) + "\n\n" + "".join(notes) + f"Command: `{command}`\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG chart", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(runs)))
    colors = ["#bbbbbb", "#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3", "#a6d854", "#ffd92f"]
    assert len(colors) == len(order)
    labels = [f"{kind} ({cache}){' *' if r.get('measured_in') else ''}" for kind, cache, r in runs]
    # a start of minutes (the naive path) would squash every other bar: cut it at the axis
    totals = [total(r) for _, _, r in runs]
    short = [t for t in totals if t < max(totals) / 3]  # the naive path's warm and cold bars are both cut
    xmax = 1.4 * max(short) if short else max(totals)
    for i, (kind, cache, r) in enumerate(runs):
        left = 0.0
        for k, c in zip(order, colors):
            w = r["phases"].get(k, 0.0)
            ax.barh(i, w, left=left, color=c, label=k if i == 0 else None)
            left += w
        if left > xmax:  # the label inside the cut bar's end
            ax.text(xmax, i, f"{total(r):.1f} s (bar cut) ", va="center", ha="right", fontsize=8,
                    bbox=dict(facecolor="white", edgecolor="none", pad=1))
        else:
            ax.text(left + 0.3, i, f"{total(r):.1f} s", va="center", fontsize=8)
    ax.set_xlim(0, xmax + 4)
    ax.set_yticks(range(len(runs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the controller adding the replica to RUNNING")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "coldstart-report.png", dpi=120)


def finish(res: dict, out_dir: str, report_dir: str | None, command: str) -> None:
    """serve.json / serve.md (and the report) from the measurements in ``res``."""
    summary: dict = {}
    if "scale_up" in res:
        summary["scale_up_decision_to_first_answer_s"] = res["scale_up"]["decision_to_first_answer_s"]
    if "disk" in res:
        disk_s = res["disk"]["nbytes"] / 1e9 / res["disk"]["GBps"]
        summary["disk_GBps"], summary["disk_read_s"] = res["disk"]["GBps"], disk_s
        if "minimal" in res.get("cold", {}):
            summary["cold_goal_s"] = total(res["cold"]["minimal"]) + disk_s
        if "minimal-cached" in res.get("cold", {}):
            summary["cold_goal_cached_s"] = total(res["cold"]["minimal-cached"]) + disk_s
    fresh = res.get("fresh", {})
    for kind, key in (("coldstart", "fresh_node_s"), ("minimal", "fresh_node_minimal_s"),
                      ("coldstart-nokernels", "fresh_node_no_kernels_s")):
        if kind in fresh:
            summary[key] = total(fresh[kind])
    if "fresh_node_minimal_s" in summary and "disk_read_s" in summary:
        summary["fresh_node_goal_s"] = summary["fresh_node_minimal_s"] + summary["disk_read_s"] + 1.0
    for cache in ("warm", "cold"):
        r = res.get(cache, {})
        for kind, v in r.items():
            summary[f"{kind}_{cache}_s"] = total(v)
        rounds = res.get(f"{cache}_runs_s", {})
        for ours, floor, _ in MINUS:  # against each floor measured in the run
            if ours in r and floor in r:
                summary[_key(ours, "minus", floor, cache, "s")] = (
                    total(r[ours]) - total(r[floor]))
            d = paired(rounds, ours, floor)  # and round by round, where both were deployed in every round
            if d:
                summary[_key(ours, "minus", floor, cache, "rounds", "s")] = d
        for ours, floor, _ in OVER:
            if ours in r and floor in r:
                summary[_key(ours, "over", floor, cache)] = total(r[ours]) / total(r[floor])
        for kind in rounds:  # a variant (--variant NAME: kind coldstart-NAME) against the default
            d = paired(rounds, kind, "coldstart") if kind.startswith("coldstart-") else None
            if d and kind not in (ours for ours, _, _ in MINUS):
                summary.setdefault(f"variants_minus_coldstart_{cache}_rounds_s", {})[kind] = d
    # a variant (--variant) may compute otherwise (torch kernels instead of Triton's): only the
    # default replica's starts are held to one answer
    answers = [a["token_ids"] for a in res.get("answers", []) if a["kind"] in SAME_ANSWER]
    if answers:  # greedy, one prompt, one checkpoint: every start must answer alike
        summary["answers"] = len(answers)
        summary["answers_agree"] = all(a == answers[0] for a in answers)
    summary["command"] = command
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps({**summary, "detail": res}, indent=2))
    md = ["A replica's start as Ray reports it: from the controller adding the replica to the controller "
          "marking it RUNNING (constructor, reconfigure, Ray's gc.collect() and first health check done), "
          "each deployment alone. Runs without that figure (carried from runs before it was recorded) give "
          "deploy -> replica warm.", "",
          "| replica | warm cache s | cold cache s | fresh node s |", "|---|---|---|---|"]
    def cell(cache: str, k: str) -> str:
        r = res.get(cache, {}).get(k)
        if r is None:
            return ""
        return f"{total(r):.2f}" + (f" (from another run: {r['measured_in']})"
                                                 if r.get("measured_in") else "")
    for k in dict.fromkeys([*res.get("warm", {}), *res.get("cold", {}), *res.get("fresh", {})]):
        md.append(f"| {k} | {cell('warm', k)} | {cell('cold', k)} | {cell('fresh', k)} |")
    missing = [k for k in res.get("warm", {}) if res.get("cold") and k not in res["cold"]]
    if missing:
        md.append(f"Not measured with a cold cache in this run: {', '.join(missing)}.")
    for cache in ("warm", "cold", "fresh"):
        for k, ts in res.get(f"{cache}_runs_s", {}).items():
            md.append(f"{k}, {cache} cache: {len(ts)} deploys, {', '.join(f'{t:.2f}' for t in ts)} s; the median counts.")
    md += [""] + goal_lines(summary)
    def rounded(v: object) -> object:
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return v if isinstance(v, bool) else [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)
    md += ["", json.dumps({k: rounded(v) for k, v in summary.items() if k != "command"}), "",
           f"Command: `{command}`", ""]
    (out / "serve.md").write_text("\n".join(md))
    print("\n".join(md))
    if report_dir:
        write_report(res, Path(report_dir), command)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/coldstart-bench",
                    help="where the 7B checkpoint is made (if absent) and packed")
    ap.add_argument("--hf", help="an HF checkpoint directory instead (default: WORK/hf)")
    ap.add_argument("--packed", help="its packed copy (default: WORK/packed)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
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
        env = {**CONFIG_ENV, **(v.get("env") or {})}
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
        # measured, as on a node that ran the model before: a new node's first replica compiles
        # them (its engine took 5.2 s instead of 1.0-1.8 in serve-v21's first round)
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
