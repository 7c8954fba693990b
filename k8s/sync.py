"""Regenerate the GPU-node Serve configs from serve_config.yaml.

serve_config.yaml is the source of truth for the application (import path,
args, autoscaling, user_config, health checks). Its defaults run anywhere,
CPU included. GPU nodes serve the same application with a few settings
changed, all listed in `gpu_overlay` and nothing else:

- `k8s/rayservice.yaml`: its `serveConfigV2` block (only the text of that
  block is rewritten, so the rest of the file keeps its comments; only
  `applications` is copied, since KubeRay owns the proxies' host and port);
- `serve_config.gpu.yaml`: for cluster.yaml and the Docker image;
- `serve_config.zero.yaml`: the GPU config scaled to zero when idle, its model in object
  storage (`zero_overlay`).

    python k8s/sync.py            # rewrite both
    python k8s/sync.py --check    # exit 1 if either is out of date (CI)
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "serve_config.yaml"
RAYSERVICE = ROOT / "k8s" / "rayservice.yaml"
GPU_CONFIG = ROOT / "serve_config.gpu.yaml"
# where cluster.yaml and k8s/rayservice.yaml mount the packed model
GPU_MODEL = "/models/llama-2-7b"
_BLOCK = re.compile(r"^(?P<indent>[ \t]*)serveConfigV2:[ \t]*\|[-+]?[ \t]*$", re.MULTILINE)
HEADER = ("# generated from serve_config.yaml + gpu_overlay by k8s/sync.py:\n"
          "# edit serve_config.yaml, then run python k8s/sync.py\n")


def serve_applications(serve_config: Path = SERVE_CONFIG) -> list[dict[str, Any]]:
    """The `applications` list of a Serve config file."""
    cfg = yaml.safe_load(serve_config.read_text())
    if not isinstance(cfg, dict) or not isinstance(cfg.get("applications"), list):
        raise ValueError(f"{serve_config}: expected a top-level `applications:` list")
    return cfg["applications"]


GPU_MAX_SEQ_LEN = 4096
# a GPU replica's engine: a paged KV cache in the memory the weights leave, up to 128 sequences
# decoded at once, 2048-token prefill chunks (16 fresh 128-token prompts a forward);
# docs/measurements.md "Paged KV cache" has the figures that chose them
GPU_ENGINE = {"kv_cache": "paged", "max_slots": 128, "prefill_chunk": 2048}


def gpu_overlay(cfg: dict[str, Any]) -> dict[str, Any]:
    """serve_config for GPU nodes: every deployment that has a `num_gpus` knob gets one
    GPU (one replica per GPU) and 4 CPUs (the loader's reader threads), `args.model`
    points at the mounted model (the setup hook's COLDSTART_EARLY_WEIGHTS too) with a 4096-token
    context and the engine of ``GPU_ENGINE``, Ray's
    limits follow what that replica holds (autoscaling's target: its ``max_slots``; requests sent
    to it: twice that, the rest waiting in its engine's queue; Ray's own queue: twice that again),
    and the proxies listen on all interfaces (inside a container 127.0.0.1 is unreachable from
    outside)."""
    cfg = copy.deepcopy(cfg)
    cfg.setdefault("http_options", {})["host"] = "0.0.0.0"
    for app in cfg["applications"]:
        if "model" in (app.get("args") or {}):
            app["args"]["model"] = GPU_MODEL
            # a 7B model's full context; on a 40 GB A100 the paged cache holds ~45,000 positions
            # beside 13.5 GB of weights (128 sequences of ~350 tokens on average, fewer longer ones)
            app["args"].setdefault("engine", {}).update(max_seq_len=GPU_MAX_SEQ_LEN, **GPU_ENGINE)
            # a new node's worker setup hook starts reading the weights (deployments/startup/early.py)
            app.setdefault("runtime_env", {}).setdefault("env_vars", {})["COLDSTART_EARLY_WEIGHTS"] = GPU_MODEL
        for dep in app.get("deployments", []):
            opts = dep.get("ray_actor_options") or {}
            if "num_gpus" in opts:
                opts["num_gpus"] = 1
                opts["num_cpus"] = max(opts.get("num_cpus", 1), 4)
                slots = GPU_ENGINE["max_slots"]
                dep["max_ongoing_requests"] = 2 * slots
                dep["max_queued_requests"] = 4 * slots
                if dep.get("autoscaling_config"):
                    dep["autoscaling_config"]["target_ongoing_requests"] = slots
    return cfg


ZERO_CONFIG = ROOT / "serve_config.zero.yaml"
# where serve_config.zero.yaml's nodes find the packed model: object storage (`coldstart push`)
ZERO_MODEL = "s3://models/llama-2-7b"
# a deployment scaled to zero: Ray's proxy holds the first request until a replica is warm. The
# proxy reports the held request with its metrics, so their interval is how late the replica is
# added (Ray's scale from zero waits for no upscale delay or look-back); the replica is then kept
# a while (docs/operations.md "Scale from zero")
ZERO_AUTOSCALING = {"min_replicas": 0, "initial_replicas": 0, "metrics_interval_s": 0.5,
                    "downscale_to_zero_delay_s": 900}


def zero_overlay(cfg: dict[str, Any]) -> dict[str, Any]:
    """serve_config.gpu.yaml's application scaled to zero when idle, its model in object storage:
    any GPU node can start a replica (it fetches the model from its peers or the store once)."""
    cfg = gpu_overlay(cfg)
    for app in cfg["applications"]:
        if "model" in (app.get("args") or {}):
            app["args"]["model"] = ZERO_MODEL
            app.get("runtime_env", {}).get("env_vars", {}).pop("COLDSTART_EARLY_WEIGHTS", None)
        for dep in app.get("deployments", []):
            if dep.get("autoscaling_config"):
                dep["autoscaling_config"].update(ZERO_AUTOSCALING)
    return cfg


def render_zero_config(cfg: dict[str, Any]) -> str:
    return ("# generated from serve_config.yaml by k8s/sync.py (see zero_overlay there):\n"
            "# edit serve_config.yaml, then run python k8s/sync.py\n"
            + yaml.safe_dump(zero_overlay(cfg), sort_keys=False, width=100))


def render_gpu_config(cfg: dict[str, Any]) -> str:
    return ("# generated from serve_config.yaml by k8s/sync.py (see gpu_overlay there):\n"
            "# edit serve_config.yaml, then run python k8s/sync.py\n"
            + yaml.safe_dump(gpu_overlay(cfg), sort_keys=False, width=100))


def find_block(text: str) -> tuple[int, int, str]:
    """(start, end, indent) of the serveConfigV2 block scalar's body in `text`."""
    m = _BLOCK.search(text)
    if m is None:
        raise ValueError("k8s/rayservice.yaml: no `serveConfigV2: |` block found")
    indent = m.group("indent")
    start = m.end() + 1
    pos = start
    for line in text[start:].splitlines(keepends=True):
        body_indent = len(line) - len(line.lstrip(" "))
        if line.strip() and body_indent <= len(indent):
            break
        pos += len(line)
    return start, pos, indent


def render(rayservice_text: str, applications: list[dict[str, Any]]) -> str:
    """`rayservice_text` with its serveConfigV2 body replaced by `applications`."""
    start, end, indent = find_block(rayservice_text)
    body = HEADER + yaml.safe_dump({"applications": applications}, sort_keys=False,
                                   default_flow_style=False, width=100)
    pad = indent + "  "
    new = "".join(pad + line if line.strip() else line for line in body.splitlines(keepends=True))
    return rayservice_text[:start] + new + rayservice_text[end:]


def rayservice_applications(rayservice_text: str) -> list[dict[str, Any]]:
    """The applications of the RayService document's serveConfigV2."""
    for doc in yaml.safe_load_all(rayservice_text):
        if isinstance(doc, dict) and doc.get("kind") == "RayService":
            return yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    raise ValueError("k8s/rayservice.yaml: no RayService document")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if out of date; write nothing")
    ap.add_argument("--serve-config", type=Path, default=SERVE_CONFIG)
    ap.add_argument("--rayservice", type=Path, default=RAYSERVICE)
    ap.add_argument("--gpu-config", type=Path, default=GPU_CONFIG)
    ap.add_argument("--zero-config", type=Path, default=ZERO_CONFIG)
    a = ap.parse_args(argv)
    cfg = yaml.safe_load(a.serve_config.read_text())
    serve_applications(a.serve_config)  # validates the shape
    apps = gpu_overlay(cfg)["applications"]
    old_rs = a.rayservice.read_text()
    new_rs = render(old_rs, apps)
    old_gpu = a.gpu_config.read_text() if a.gpu_config.exists() else ""
    new_gpu = render_gpu_config(cfg)
    old_zero = a.zero_config.read_text() if a.zero_config.exists() else ""
    new_zero = render_zero_config(cfg)
    files = ((a.rayservice, old_rs, new_rs), (a.gpu_config, old_gpu, new_gpu), (a.zero_config, old_zero, new_zero))
    if a.check:
        stale = [str(p) for p, old, new in files if old != new]
        if stale:
            print(f"{', '.join(stale)} out of date with {a.serve_config}: run python k8s/sync.py",
                  file=sys.stderr)
            return 1
        return 0
    for path, old, new in files:
        if new != old:
            path.write_text(new)
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
