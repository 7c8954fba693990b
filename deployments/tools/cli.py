"""The ``coldstart`` command: pack, verify, demo, kernels, serve, status, doctor."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

DEMO_DIR = Path("weights/demo")


def _cmd_pack(a: argparse.Namespace) -> int:
    from weights import PackOptions, pack
    opts = PackOptions(dtype=a.dtype, force=a.force, chunk_bytes=a.chunk_mib << 20,
                       progress=not a.quiet, tp=a.tp, quantize=a.quantize)
    dest = pack(a.src, a.dest, opts)
    _print_packed(dest, "packed", opts.tp)
    return 0


def _print_packed(dest: Path, what: str, tp: int) -> None:
    from weights import read_packed
    from weights.quant import describe_packed
    if tp == 1:
        pf = read_packed(dest)
        print(f"{what} {len(pf.tensors)} tensors, {pf.data_bytes / 1e9:.3f} GB{describe_packed(pf.index.metadata)}, "
              f"into {dest} (digest {pf.digest[:16]})")
        return
    from weights.tp import rank_path
    pfs = [read_packed(rank_path(dest, k)) for k in range(tp)]
    print(f"{what} {len(pfs[0].tensors)} tensors split over {tp} ranks, {pfs[0].data_bytes / 1e9:.3f} GB per "
          f"rank{describe_packed(pfs[0].index.metadata)}, into {dest}/rank-0 ... rank-{tp - 1} "
          f"(digests {', '.join(pf.digest[:16] for pf in pfs)})")


def _cmd_verify(a: argparse.Namespace) -> int:
    from weights import verify
    from weights.quant import describe_packed
    bar = None
    if sys.stderr.isatty() and not a.quiet:
        from tqdm import tqdm
        bar = tqdm(unit="B", unit_scale=True, desc="verify")
    last = [0]

    def progress(done: int) -> None:
        if bar is not None:
            bar.update(done - last[0])
            last[0] = done
    report = verify(a.dest, progress=progress)
    if bar is not None:
        bar.close()
    for p in report.problems():
        print(p, file=sys.stderr)
    for n in report.notes:
        print(f"note: {n}", file=sys.stderr)
    if not report.ok:
        print(f"FAILED: {report.summary()}; re-copy or re-pack the model", file=sys.stderr)
        return 1
    for r in getattr(report, "ranks", [report]):  # a split pack's: one line per rank
        pf = r.packed
        rank = f"rank {pf.tp['rank']} of {pf.tp['size']}, " if pf.tp else ""
        print(f"ok: {pf.path} ({rank}{len(pf.tensors)} tensors, {pf.data_bytes / 1e9:.3f} GB"
              f"{describe_packed(pf.index.metadata)}, {len(pf.index.chunk_sums)} chunks, digest {pf.digest[:16]})")
    return 0


def _cmd_demo(a: argparse.Namespace) -> int:
    from weights import make_demo
    dest = make_demo(a.dest, a.shape, device=a.device, seed=a.seed, force=a.force, layers=a.layers, tp=a.tp,
                     quant=a.quant)
    layers = f" ({a.layers} layers)" if a.layers else ""
    layers += f", {a.quant}" if a.quant else ""
    if a.tp > 1:
        _print_packed(dest, f"wrote a random {a.shape}{layers} model, packed:", a.tp)
    else:
        print(f"wrote a random {a.shape}{layers} Llama checkpoint to {dest}")
    return 0


def ensure_demo(dest: Path = DEMO_DIR, shape: str = "tiny") -> Path:
    """Make and pack the demo model into ``dest`` unless a packed model is there."""
    if (dest / "model.cst").is_file():
        return dest
    from weights import PackOptions, make_demo, pack
    with tempfile.TemporaryDirectory(prefix="coldstart-demo-") as tmp:
        src = make_demo(Path(tmp) / "hf", shape)
        pack(src, dest, PackOptions(force=dest.exists(), progress=False))
    logging.getLogger(__name__).info("made and packed the %s demo model into %s", shape, dest)
    return dest


APP_IMPORT_PATH = "deployments.app:build_app"


def derived_config(config_text: str, gpus: float | None = None, model: str | Path | None = None,
                   tp: int | None = None) -> str:
    """The serve config with ``num_gpus`` set for every deployment's replicas (``gpus``),
    ``args.model`` set for every coldstart application (``model``, and COLDSTART_EARLY_WEIGHTS in
    its runtime_env), and ``args.tp`` with the
    placement group it needs (``tp``: N bundles, each the replica's own resources; one node); the
    rest as it was."""
    import yaml

    from weights.remote import is_remote
    cfg = yaml.safe_load(config_text) or {}
    apps = cfg.get("applications") or []
    ours = [app for app in apps if app.get("import_path") == APP_IMPORT_PATH]
    if (model is not None or tp is not None) and not ours:
        raise ValueError(f"the config has no application with import_path {APP_IMPORT_PATH}: "
                         "nothing to point at the model")
    for app in ours:
        if model is not None:
            app["args"] = {**(app.get("args") or {}), "model": str(model)}
            # the worker setup hook starts reading its weights on a node where they are not cached
            env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
            if is_remote(str(model)):  # a remote model arrives through the node cache, not a file to read ahead
                env.pop("COLDSTART_EARLY_WEIGHTS", None)
            else:
                env["COLDSTART_EARLY_WEIGHTS"] = str(model)
        if tp is not None:
            app["args"] = {**(app.get("args") or {}), "tp": tp}
    for app in apps:
        for dep in app.get("deployments") or []:
            if gpus is not None:
                # `ray_actor_options:` left empty in YAML is None: replace it, don't drop the setting
                dep["ray_actor_options"] = {**(dep.get("ray_actor_options") or {}), "num_gpus": gpus}
            if tp is not None and app in ours:
                if tp == 1:
                    dep.pop("placement_group_bundles", None)
                    dep.pop("placement_group_strategy", None)
                    continue
                opts = dep.get("ray_actor_options") or {}
                bundle = {"CPU": float(opts.get("num_cpus", 1))}
                if opts.get("num_gpus"):
                    bundle["GPU"] = float(opts["num_gpus"])
                dep["placement_group_bundles"] = [dict(bundle) for _ in range(tp)]
                dep["placement_group_strategy"] = "STRICT_PACK"
    return yaml.safe_dump(cfg, sort_keys=False)


def model_to_serve(path: str | Path, tp: int | None) -> tuple[Path | str, int | None]:
    """``path`` as an absolute packed model directory and the ranks it is served on (None: as the
    config says, one), checked before Ray starts: one model (``packed_model``), or a split pack
    whose every rank's file reads (served over as many ranks; ``tp``, where given, must agree).
    A remote model (``s3://...``) stays its URI, its header read and checked at the source."""
    from weights.format import read_manifest, read_packed
    from weights.remote import is_remote
    from weights.tp import is_split_pack, rank_path
    if is_remote(str(path)):
        return remote_to_serve(str(path), tp)
    p = Path(path).expanduser().resolve()
    if not is_split_pack(p):
        packed_model(p)
        if tp not in (None, 1):
            raise ValueError(f"--tp {tp}: {p} is one unsplit model; pack it for {tp} ranks with "
                             f"`coldstart pack SRC DEST --tp {tp}`, or leave --tp out")
        return p, tp
    size = read_manifest(p)["size"]
    if tp is not None and tp != size:
        raise ValueError(f"--tp {tp}: {p} is split over {size} ranks; leave --tp out (it is read from the pack)")
    for k in range(size):
        read_packed(rank_path(p, k))
    return p, size


def packed_model(path: str | Path) -> Path:
    """``path`` as an absolute packed model directory, checked before Ray starts (its preamble and
    index: a replica would fail on them later, after Ray's own start). A missing file or a
    PackedFormatError says what is wrong and what to do."""
    from weights.format import read_packed
    p = Path(path).expanduser().resolve()
    read_packed(p)
    return p


def check_config(path: str) -> list[str]:
    """A YAML config given to ``coldstart serve`` exists and holds Serve's ``applications``
    list, checked before Ray starts (``serve run`` would take a missing file for an import
    path and fail with a traceback). An import path (``module:app``) is left to ``serve run``.
    Returns notes on settings that work against a replica's capacity (``capacity_notes``)."""
    import yaml
    p = Path(path)
    if p.suffix not in (".yaml", ".yml"):
        return []
    if not p.is_file():
        where = "" if p.is_absolute() else f" in {Path.cwd()}"
        raise FileNotFoundError(f"{path}: no such config file{where}; run from the project's directory "
                                "or give the config's path")
    try:
        with p.open(encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("applications"), list) or not cfg["applications"]:
        raise ValueError(f"{path}: a Serve config needs an `applications:` list with at least one "
                         "application (see serve_config.yaml)")
    from deployments.config import DeploymentArgs, UserConfig, parse
    notes = []
    for app in cfg["applications"]:
        if isinstance(app, dict) and app.get("import_path") == APP_IMPORT_PATH:
            try:
                args = parse(DeploymentArgs, app.get("args"), "args")
                for dep in app.get("deployments") or []:
                    if isinstance(dep, dict) and dep.get("user_config") is not None:
                        parse(UserConfig, dep["user_config"], "user_config")
            except ValueError as e:
                raise ValueError(f"{path}: application {app.get('name')!r}: {e}") from None
            notes += [f"{path}: application {app.get('name')!r}: {n}" for dep in app.get("deployments") or []
                      if isinstance(dep, dict) for n in capacity_notes(args, dep)]
    return notes


def capacity_notes(args: Any, dep: dict) -> list[str]:
    """What in a deployment's options works against what one replica holds (``engine.max_slots``
    sequences decoded at once): Ray's autoscaling target above it makes requests queue inside
    full replicas before Ray adds one; a max_ongoing_requests below it leaves slots that never fill."""
    slots = args.engine.max_slots
    target = (dep.get("autoscaling_config") or {}).get("target_ongoing_requests")
    most = dep.get("max_ongoing_requests")
    out = []
    if isinstance(target, (int, float)) and target > slots:
        out.append(f"autoscaling_config.target_ongoing_requests {target} is above engine.max_slots {slots}: requests "
                   f"queue inside full replicas before Ray adds one; set it to {slots} or less")
    if isinstance(most, int) and most < slots:
        out.append(f"max_ongoing_requests {most} is below engine.max_slots {slots}: {slots - most} of each "
                   f"replica's slots never fill; raise it to {slots} or more")
    return out


def remote_to_serve(uri: str, tp: int | None) -> tuple[str, int | None]:
    """A remote model's URI and ranks, its weight file's (or every rank's) header checked at the source."""
    import json as _json

    from weights.fetch import read_header, weight_rel
    from weights.format import TP_MANIFEST
    from weights.remote import Origin
    origin = Origin(uri)
    if origin.exists(TP_MANIFEST):
        size = int(_json.loads(origin.get(TP_MANIFEST))["size"])
        if tp is not None and tp != size:
            raise ValueError(f"--tp {tp}: {uri} is split over {size} ranks; leave --tp out (it is read from the pack)")
        for k in range(size):
            read_header(origin, weight_rel(k), Path("/") / weight_rel(k))
        return origin.uri, size
    read_header(origin, weight_rel(None), Path("/") / weight_rel(None))
    if tp not in (None, 1):
        raise ValueError(f"--tp {tp}: {uri} is one unsplit model; pack it for {tp} ranks with `coldstart pack SRC "
                         f"DEST --tp {tp}` and push that, or leave --tp out")
    return origin.uri, tp


def _cmd_push(a: argparse.Namespace) -> int:
    """Upload a packed model (checked first: structure and every chunk) to object storage."""
    from weights.remote import push
    names = push(a.dir, a.uri)
    print(f"pushed {len(names)} files of {a.dir} to {a.uri.rstrip('/')}; serve it with "
          f"`coldstart serve --model {a.uri.rstrip('/')} serve_config.gpu.yaml`")
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    if a.gpus is not None and not a.gpus >= 0:
        raise ValueError(f"--gpus {a.gpus}: give the GPUs per replica, 0 or more (0.5 shares a GPU)")
    if a.tp is not None and a.tp < 1:
        raise ValueError(f"--tp {a.tp}: give the tensor-parallel ranks per replica, 1 or more")
    model, tp = model_to_serve(a.model, a.tp) if a.model else (None, a.tp)
    for note in check_config(a.config):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    if model is None:
        ensure_demo()
    serve = _serve_executable()
    config = a.config
    if a.gpus is not None or model is not None or tp is not None:
        # a derived copy: relative paths in it are taken from here (cwd), as the original's
        derived = Path(tempfile.gettempdir()) / f"coldstart-serve-{os.getpid()}.yaml"
        derived.write_text(derived_config(Path(a.config).read_text(), a.gpus, model, tp))
        changes = ", ".join(c for c in (a.gpus is not None and f"num_gpus={a.gpus} per replica",
                                        model is not None and f"args.model={model}",
                                        tp is not None and f"args.tp={tp}") if c)
        print(f"{a.config} with {changes}: {derived}", flush=True)
        config = str(derived)
    cmd = [serve, "run", config, *a.serve_args]
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    for sig in (signal.SIGINT, signal.SIGTERM):  # (a terminal's Ctrl-C reaches both processes anyway)
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    url = health_url(Path(config).read_text()) if config.endswith((".yaml", ".yml")) else None

    def done_with_config() -> None:
        if config != a.config:  # the derived copy: `serve run` read it as it began
            Path(config).unlink(missing_ok=True)
    if url is not None:
        threading.Thread(target=_announce_ready, args=(url, proc, done_with_config), daemon=True).start()
    try:
        return proc.wait()
    finally:
        done_with_config()


def health_url(config_text: str) -> str | None:
    """Where the config's coldstart application answers ``/health`` (its HTTP options and route
    prefix); None where it has no coldstart application."""
    import yaml
    cfg = yaml.safe_load(config_text) or {}
    http = cfg.get("http_options") or {}
    host = str(http.get("host") or "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    prefix = next(((app.get("route_prefix") or "/") for app in cfg.get("applications") or []
                   if app.get("import_path") == APP_IMPORT_PATH), None)
    if prefix is None:
        return None
    return f"http://{host}:{http.get('port', 8000)}{prefix.rstrip('/')}/health"


def _announce_ready(url: str, proc: subprocess.Popen, then: Callable[[], None], step: float = 0.5) -> None:
    """Print one line when the application first answers ``url`` with a 200 (warm), so that a
    user need not read Ray's log or guess from 404s, then call ``then``; nothing if `serve run`
    ends first."""
    import urllib.error
    import urllib.request
    t0 = time.monotonic()
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    base = url.removesuffix("/health")
                    print(f"ready: {base} answers after {time.monotonic() - t0:.1f} s "
                          f"(try: curl -X POST {base}/generate -d '{{\"prompt\": \"The answer is \"}}')", flush=True)
                    then()
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(step)


def _cmd_kernels(a: argparse.Namespace) -> int:
    """Start the packed model once on this node's GPU with an empty Triton cache (every decode
    graph captured, the warm-up run), then keep what the start compiled in DIR/kernels/<key>/, so
    that replicas on new nodes of this GPU kind compile nothing (deployments.kernels.bundle)."""
    from weights.format import read_manifest
    from weights.tp import is_split_pack
    if is_split_pack(a.dir):
        raise ValueError(f"{a.dir} is split over {read_manifest(a.dir)['size']} tensor-parallel ranks: `coldstart "
                         "kernels` keeps the kernels of a one-device pack only; a split pack's ranks compile theirs "
                         "at their first start on each node")
    model = packed_model(a.dir)
    cache = tempfile.mkdtemp(prefix="coldstart-kernels-")
    os.environ["TRITON_CACHE_DIR"] = cache  # before anything imports Triton
    from deployments.config import DeploymentArgs
    from deployments.engine.warmup import WarmupPlan, run_warmup
    from deployments.kernels import bundle
    from deployments.server.start import Start
    from weights.timing import PhaseTimer
    engine = {"max_slots": a.max_slots, "lazy_graphs": False, "kv_cache": a.kv_cache,
              **({"max_seq_len": a.max_seq_len} if a.max_seq_len else {})}
    start = Start(DeploymentArgs(model=str(model), device=a.device, engine=engine), PhaseTimer()).run()
    try:
        if start.device.type != "cuda" or not getattr(getattr(start.model, "kernels", None), "fused", False):
            raise ValueError(f"{model}: the decode kernels did not run here (device {start.device}, kernels "
                             f"{getattr(start.model, 'kernels', None)}): run `coldstart kernels` on a GPU node with Triton")
        seed = start.tokenizer.encode("The answer is forty-two. " * 8, add_special_tokens=False) or [3]
        run_warmup(start.engine, WarmupPlan(batch_sizes=list(start.engine.config.graph_batch_sizes)), seed)
    finally:
        start.engine.shutdown()
    dest = bundle.write(model, cache)
    n = len(json.loads((dest / bundle.MANIFEST).read_text())["files"])
    print(f"kept {n} compiled files for {bundle.node_facts()['gpu']} in {dest}")
    shutil.rmtree(cache, ignore_errors=True)
    return 0


def _cmd_status(a: argparse.Namespace) -> int:
    """`serve status` against the Ray instance `coldstart serve` started: that Ray requires its
    token (token authentication), which `serve status` sends only where RAY_AUTH_MODE=token."""
    serve = _serve_executable()
    env = {**os.environ}
    env.setdefault("RAY_AUTH_MODE", "token")
    cmd = [serve, "status", *a.serve_args]
    os.execve(cmd[0], cmd, env)
    return 0


def _serve_executable() -> str:
    """Ray's `serve` command beside this interpreter, else on PATH."""
    serve = str(Path(sys.executable).with_name("serve"))
    return serve if Path(serve).exists() else (shutil.which("serve") or serve)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="coldstart", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pack", help="pack a Hugging Face model directory")
    p.add_argument("src", help="local HF model directory (config.json + safetensors or .bin)")
    p.add_argument("dest", help="packed model directory to create, e.g. weights/llama-2-7b")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="cast floating-point weights (fp8 and integer tensors stay as they are)")
    p.add_argument("--force", action="store_true", help="replace DEST if it exists")
    p.add_argument("--chunk-mib", type=int, default=16, help="checksum chunk size in MiB")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="split over N tensor-parallel ranks: DEST/rank-K/model.cst for each rank K")
    p.add_argument("--quantize", choices=["fp8"],
                   help="fp8: store every layer's projection weights as float8_e4m3fn with one scale per output "
                        "channel (from an fp16/bf16/fp32 checkpoint)")
    p.set_defaults(fn=_cmd_pack)

    p = sub.add_parser("verify", help="check a packed model's structure and checksums")
    p.add_argument("dest")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(fn=_cmd_verify)

    p = sub.add_parser("push", help="upload a packed model to object storage (s3://, gs://), for any node to serve")
    p.add_argument("dir", help="a packed model directory (checked before the upload)")
    p.add_argument("uri", help="where it goes, e.g. s3://models/llama-2-7b (credentials: the client's own, "
                               "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL, an instance role)")
    p.set_defaults(fn=_cmd_push)

    p = sub.add_parser("demo", help="write a random Llama checkpoint (HF format) for tests/benchmarks")
    p.add_argument("dest")
    from weights.demo import SHAPES
    p.add_argument("--shape", choices=list(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu", help="where to draw the random weights (cuda is fast)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    p.add_argument("--layers", type=int, metavar="N", help="write only N of the shape's layers (its widths kept)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="write the model packed and split over N tensor-parallel ranks (as `pack --tp N` of "
                        "the checkpoint), not the checkpoint")
    from weights.quantize import DEMO_FORMATS
    p.add_argument("--quant", choices=list(DEMO_FORMATS),
                   help="write the checkpoint quantized in this format (random weights in its layout)")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("serve", help="`serve run` the config (making the demo model if it serves the demo)")
    p.add_argument("--gpus", type=float, default=None,
                   help="GPUs per replica (the default config asks for none: CPU)")
    p.add_argument("--model", metavar="DIR|URI",
                   help="a packed model directory, or one in object storage (s3://..., https://...), to serve "
                        "instead of the config's args.model (a split pack is served over its ranks)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks per replica (one GPU each, one node); read from a split "
                        "pack given with --model")
    p.add_argument("config", nargs="?", default="serve_config.yaml")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="passed on to `serve run`")
    p.set_defaults(fn=_cmd_serve)

    p = sub.add_parser("kernels", help="compile the decode kernels for this node's GPU kind and keep them "
                                       "in the packed model (DIR/kernels/), for new nodes")
    p.add_argument("dir", help="a packed model directory")
    p.add_argument("--device", default="cuda", help="the GPU to compile on (cuda, cuda:N)")
    p.add_argument("--max-slots", type=int, default=8, help="as the replicas' engine.max_slots")
    p.add_argument("--max-seq-len", type=int, default=None, help="as the replicas' engine.max_seq_len")
    p.add_argument("--kv-cache", choices=["static", "paged"], default="static",
                   help="as the replicas' engine.kv_cache (its kernels are compiled apart; run once per setting "
                        "served: each run adds to the bundle)")
    p.set_defaults(fn=_cmd_kernels)

    p = sub.add_parser("status", help="`serve status` of the running application (with the Ray token it needs)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="passed on to `serve status`")
    p.set_defaults(fn=_cmd_status)

    # `coldstart doctor ...` is dispatched in main() to deployments.tools.doctor's own parser
    sub.add_parser("doctor", help="check driver, CUDA, GPU visibility, disk and copy speed "
                                  "(coldstart doctor --help)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:  # its own parser: argparse's REMAINDER drops leading --flags
        from deployments.tools.doctor import main as doctor_main
        return doctor_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        print(f"coldstart {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # PackedFormatError and friends: a clear line, not a trace
        from weights.format import PackedFormatError
        if isinstance(e, PackedFormatError):
            print(f"coldstart {args.cmd}: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
