"""`coldstart doctor`: check that this machine can start a replica fast, and say why not.

The article's layer 1 ("lock the environment, check the driver at start-up") and
its troubleshooting table as one command. Each check returns a ``Check`` with a
status (ok / warn / fail / skip), what it saw, and what to do about it::

    coldstart doctor                       # table on stdout
    coldstart doctor --model /models/llama-7b --read-gib 4
    coldstart doctor --json                # machine output
    python -m deployments.tools.doctor --require-gpu

Exit code 0 when no check failed, 1 otherwise. Without a GPU the GPU checks say
``skip`` (``fail`` with ``--require-gpu``). torch is imported inside the checks
that need it, so ``--help`` is instant. The checks run in an order that matters:
the page-cache probe before the read test (which fills the cache), and the
CUDA-context timing before anything else touches the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

from deployments.gpu_facts import (PROC_DRIVER_VERSION, GpuInfo, _loaded_libraries, _runtime_wheel_version, _vtuple,
                                   driver_cuda_version, driver_verdict, probe_driver, visibility_verdict)
from deployments.tools.check import (CONTEXT_WARN_S, DEFAULT_MODEL_DIR, PINNED_WARN_GBPS, STATUSES, Check,
                                     DoctorOptions)
from deployments.tools.doctor_files import (check_bytecode, check_kernel_cache, check_page_cache, check_read_speed,
                                            drop_page_cache, model_files)


def check_driver(opts: DoctorOptions, torch_cuda: str | None,
                 probed: tuple[str | None, list[GpuInfo], str]) -> Check:
    driver, gpus, source = probed
    data = {"driver": driver, "source": source, "gpus": [asdict(g) for g in gpus]}
    if driver is None:
        return _no_gpu("nvidia driver", opts, "no NVIDIA driver: nvidia-smi is not on PATH and "
                       f"{PROC_DRIVER_VERSION} is absent", data)
    listed = "; ".join(f"{g.index}: {g.name} {g.memory_mib} MiB" for g in gpus) or "GPUs not listed"
    if torch_cuda is None:
        return Check("nvidia driver", "warn", f"driver {driver} ({listed}), but torch is a CPU-only "
                     "build and cannot use it", "install a CUDA build of torch", data)
    status, detail, action = driver_verdict(driver, torch_cuda)
    return Check("nvidia driver", status, f"{detail} ({listed}; from {source})", action, data)


def _no_gpu(name: str, opts: DoctorOptions, why: str, data: dict | None = None) -> Check:
    if opts.require_gpu:
        return Check(name, "fail", f"--require-gpu: {why}",
                     "run on a GPU node; in a container pass --gpus all (Docker) or request "
                     "nvidia.com/gpu (Kubernetes)", data or {})
    return Check(name, "skip", f"{why}; not checked", "", data or {})


# ---------------------------------------------------------------- torch build / runtime
def check_torch_build(opts: DoctorOptions) -> tuple[Check, Any]:
    """torch's version and CUDA build. Returns (check, the torch module or None)."""
    t0 = time.perf_counter()
    try:
        import torch
    except ImportError as e:
        return Check("torch build", "fail", f"cannot import torch: {e}",
                     "pip install the project (it pins torch)"), None
    import_s = time.perf_counter() - t0
    data = {"torch": torch.__version__, "cuda": torch.version.cuda, "import_s": round(import_s, 2)}
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
        if opts.require_gpu:
            return Check("torch build", "fail", f"--require-gpu: {why}",
                         "install a CUDA build (the default torch wheel from PyPI on Linux)", data), torch
        return Check("torch build", "skip", f"{why}; GPU checks skipped "
                     f"(import took {import_s:.1f} s)", "", data), torch
    return Check("torch build", "ok", f"torch {torch.__version__} built for CUDA {torch.version.cuda}"
                 f" (import took {import_s:.1f} s)", "", data), torch


def check_cuda_runtime(opts: DoctorOptions, torch: ModuleType) -> Check:
    """The CUDA runtime torch loaded, against the one it was built for and the driver's."""
    name = "cuda runtime"
    if torch is None or torch.version.cuda is None:
        return _no_gpu(name, opts, "no CUDA build of torch")
    built = torch.version.cuda
    wheel = _runtime_wheel_version()
    cudart = _loaded_libraries(r"^libcudart\.so")
    drv = driver_cuda_version()
    data = {"built_for": built, "runtime_wheel": wheel, "libcudart": cudart, "driver_cuda": drv}
    problems, actions = [], []
    if wheel and wheel.split(".")[:2] != built.split(".")[:2]:
        problems.append(f"runtime wheel {wheel} differs from torch's CUDA {built}")
        actions.append("reinstall torch so pip brings the runtime it pins")
    foreign = [p for p in cudart if "site-packages" not in p and "dist-packages" not in p]
    if foreign:
        problems.append(f"libcudart loaded from outside the wheels: {', '.join(foreign)}")
        actions.append("unset LD_LIBRARY_PATH entries pointing at a system CUDA toolkit")
    if drv is None:
        return _no_gpu(name, opts, f"torch built for CUDA {built}, runtime wheel {wheel}; "
                       "libcuda.so.1 (the driver) not found", data)
    drv_s = f"{drv // 1000}.{drv % 1000 // 10}"
    if _vtuple(drv_s)[0] < _vtuple(built)[0]:
        problems.append(f"the driver speaks CUDA {drv_s}, older than torch's major version {built}")
        actions.append("upgrade the driver (see the nvidia driver check)")
    detail = (f"torch built for CUDA {built}; runtime {wheel or 'not from a wheel'}; "
              f"driver speaks CUDA {drv_s}; libcudart: {', '.join(cudart) or 'not loaded yet'}")
    if problems:
        status = "fail" if any("older than torch's major" in p for p in problems) else "warn"
        return Check(name, status, "; ".join(problems) + f" ({detail})", "; ".join(actions), data)
    return Check(name, "ok", detail, "", data)


# ---------------------------------------------------------------- which GPU
def check_visible_gpu(opts: DoctorOptions, torch: ModuleType, listed: list[GpuInfo]) -> Check:
    name = "visible gpu"
    count = None
    if torch is not None and torch.version.cuda is not None:
        count = torch.cuda.device_count()  # NVML-based; creates no context
    status, detail, action = visibility_verdict(os.environ, listed, count)
    data = {"torch_device_count": count, "listed": len(listed),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "NVIDIA_VISIBLE_DEVICES": os.environ.get("NVIDIA_VISIBLE_DEVICES")}
    if not listed and not count:
        return _no_gpu(name, opts, f"no GPU visible ({detail})", data)
    return Check(name, status, detail, action, data)


# ---------------------------------------------------------------- CUDA context
def check_cuda_context(opts: DoctorOptions, torch: ModuleType) -> Check:
    """Time the first CUDA context in this process: torch.cuda.init() plus the first
    allocation (the runtime creates the primary context lazily, at first use)."""
    name = "cuda context"
    if torch is None or torch.version.cuda is None:
        return _no_gpu(name, opts, "no CUDA build of torch")
    if torch.cuda.is_initialized():  # a caller made it already: a time now would be meaningless
        dev = torch.cuda.current_device()
        return Check(name, "ok", f"already created in this process on cuda:{dev} (not timed; "
                     "run `coldstart doctor` in a fresh process to time it)", "",
                     {"context_s": None, "device": dev})
    t0 = time.perf_counter()  # before anything calls cuInit (device_count would)
    try:
        torch.cuda.init()
    except (RuntimeError, AssertionError) as e:
        return _no_gpu(name, opts, f"no usable CUDA device ({e})")
    init_s = time.perf_counter() - t0
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    uuid = str(getattr(props, "uuid", "?"))
    loading = os.environ.get("CUDA_MODULE_LOADING", "unset (torch sets LAZY)")
    data = {"init_s": round(init_s, 3), "context_s": round(total_s, 3), "device": dev,
            "name": props.name, "uuid": uuid, "CUDA_MODULE_LOADING": loading}
    detail = (f"{total_s:.2f} s (torch.cuda.init {init_s:.2f} s) on cuda:{dev} = {props.name} "
              f"GPU-{uuid.removeprefix('GPU-')}; CUDA_MODULE_LOADING {loading}")
    if total_s > CONTEXT_WARN_S:
        return Check(name, "warn", detail, "export CUDA_MODULE_LOADING=LAZY (EAGER loads every "
                     "kernel of every library up front); enable persistence mode "
                     "(nvidia-smi -pm 1) so the driver stays loaded between processes", data)
    return Check(name, "ok", detail, "", data)


def check_gpu_memory(opts: DoctorOptions, torch: ModuleType) -> Check:
    name = "gpu memory"
    if torch is None or torch.version.cuda is None or not torch.cuda.is_available():
        return _no_gpu(name, opts, "no usable CUDA device")
    free, total = torch.cuda.mem_get_info()
    data = {"free_bytes": free, "total_bytes": total}
    detail = f"{free / 1e9:.1f} of {total / 1e9:.1f} GB free on cuda:{torch.cuda.current_device()}"
    if free < 0.9 * total:
        return Check(name, "warn", detail + " (something else holds memory on this GPU)",
                     "nvidia-smi --query-compute-apps=pid,used_memory --format=csv shows who", data)
    return Check(name, "ok", detail, "", data)


# ---------------------------------------------------------------- env vars
def env_verdict(env: Mapping[str, str]) -> tuple[str, str, str]:
    """Judge the environment variables that change start-up time and memory behaviour."""
    notes, warns, actions = [], [], []
    loading = env.get("CUDA_MODULE_LOADING")
    notes.append(f"CUDA_MODULE_LOADING={loading or 'unset (torch defaults to LAZY)'}")
    if loading and loading.upper() != "LAZY":
        warns.append(f"CUDA_MODULE_LOADING={loading} loads every kernel at context creation "
                     "(measured 2.6-3.7 s vs 0.3-0.4 s LAZY on an H200)")
        actions.append("export CUDA_MODULE_LOADING=LAZY")
    old, new = env.get("PYTORCH_CUDA_ALLOC_CONF"), env.get("PYTORCH_ALLOC_CONF")
    conf = new or old
    notes.append(f"allocator conf {conf!r}" if conf else "allocator conf unset")
    if old and new and old != new:
        warns.append(f"PYTORCH_ALLOC_CONF={new!r} and PYTORCH_CUDA_ALLOC_CONF={old!r} disagree "
                     "(torch reads the new name first)")
        actions.append("set only one of them")
    # torch's parser drops spaces and takes only "True": "max_split_size_mb:128, expandable_segments : True" is on
    if conf and "max_split_size_mb" in conf and not re.search(r"expandable_segments\s*:\s*True", conf):
        warns.append("max_split_size_mb without expandable_segments: fragmentation is better "
                     "fixed by expandable segments than by capping block splits")
        actions.append("use expandable_segments:True")
    if env.get("CUDA_LAUNCH_BLOCKING") == "1":
        warns.append("CUDA_LAUNCH_BLOCKING=1 serialises every kernel (a debugging setting)")
        actions.append("unset CUDA_LAUNCH_BLOCKING")
    cuda_paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if "cuda" in p.lower()]
    if cuda_paths:
        warns.append(f"LD_LIBRARY_PATH has CUDA directories {cuda_paths}: a system toolkit can "
                     "shadow the libraries torch's wheels bring")
        actions.append("drop them from LD_LIBRARY_PATH")
    if warns:
        return "warn", "; ".join(warns) + " (" + "; ".join(notes) + ")", "; ".join(actions)
    return "ok", "; ".join(notes), ""


def check_env() -> Check:
    status, detail, action = env_verdict(os.environ)
    keys = ("CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
            "CUDA_LAUNCH_BLOCKING", "LD_LIBRARY_PATH")
    return Check("env vars", status, detail, action, {k: os.environ.get(k) for k in keys})


# ---------------------------------------------------------------- host -> device
def check_pinned_h2d(opts: DoctorOptions, torch: ModuleType, nbytes: int = 256 << 20) -> Check:
    name = "pinned h2d"
    if torch is None or torch.version.cuda is None or not torch.cuda.is_available():
        return _no_gpu(name, opts, "no usable CUDA device")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # first copy pays for mapping; not timed
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    secs = start.elapsed_time(end) / 1e3
    gbps = reps * nbytes / secs / 1e9
    del host, dev
    torch.cuda.empty_cache()
    data = {"gbps": round(gbps, 2), "bytes": nbytes, "reps": reps}
    detail = f"{gbps:.1f} GB/s pinned host->device ({reps} x {nbytes >> 20} MiB)"
    if gbps < PINNED_WARN_GBPS:
        return Check(name, "warn", detail, "check the PCIe link (nvidia-smi -q -d PCI: generation "
                     "and width) and that the process runs on the GPU's NUMA node", data)
    return Check(name, "ok", detail, "", data)


# ---------------------------------------------------------------- run + report
def run_checks(opts: DoctorOptions) -> list[Check]:
    results: list[Check] = []

    def guarded(name: str, fn: Callable[[], Check]) -> None:
        try:
            results.append(fn())
        except Exception as e:  # a broken probe is a finding, not a crash of the doctor
            results.append(Check(name, "fail", f"{type(e).__name__}: {e}", "report this output"))

    build, torch = check_torch_build(opts)
    results.append(build)
    torch_cuda = torch.version.cuda if torch is not None else None
    probed = probe_driver()
    guarded("nvidia driver", lambda: check_driver(opts, torch_cuda, probed))
    guarded("cuda runtime", lambda: check_cuda_runtime(opts, torch))
    # first GPU touch in this process: before visible gpu, whose device_count() runs cuInit
    guarded("cuda context", lambda: check_cuda_context(opts, torch))
    guarded("visible gpu", lambda: check_visible_gpu(opts, torch, probed[1]))
    guarded("gpu memory", lambda: check_gpu_memory(opts, torch))
    guarded("env vars", check_env)
    guarded("kernel cache", lambda: check_kernel_cache(opts, torch))
    guarded("compiled modules", check_bytecode)
    if opts.model.exists():
        files = model_files(opts.model)
        if opts.drop_cache:  # before both rows, so they describe the same state
            drop_page_cache(files)
        guarded("page cache", lambda: check_page_cache(opts, files))  # before the read fills it
        guarded("read speed", lambda: check_read_speed(opts, files))
    else:
        status = "fail" if opts.model_given else "skip"
        why = f"{opts.model} does not exist"
        action = "pass --model DIR (a packed model directory)" if status == "fail" else \
            "pass --model DIR to test a packed model's disk"
        results += [Check("page cache", status, why, action), Check("read speed", status, why, action)]
    guarded("pinned h2d", lambda: check_pinned_h2d(opts, torch))
    if opts.tp > 1:
        from deployments.tools import doctor_tp
        guarded("tp gpus", lambda: doctor_tp.check_tp_gpus(opts, torch, _no_gpu))
        guarded("tp peer access", lambda: doctor_tp.check_tp_peers(opts, torch, _no_gpu))
        guarded("tp group start", lambda: doctor_tp.check_tp_group(opts, torch, _no_gpu))
    return results


def render_table(checks: Sequence[Check], width: int = 120) -> str:
    """A plain-text table: check / status / detail / what to do, long cells wrapped."""
    w_check = max(len("check"), *(len(c.check) for c in checks))
    w_status = len("status")
    rest = max(40, width - w_check - w_status - 6)
    w_detail, w_action = rest * 3 // 5, rest - rest * 3 // 5
    header = ("check", "status", "detail", "what to do")
    lines = [f"{header[0]:<{w_check}}  {header[1]:<{w_status}}  {header[2]:<{w_detail}}  {header[3]}",
             f"{'-' * w_check}  {'-' * w_status}  {'-' * w_detail}  {'-' * min(w_action, 30)}"]
    for c in checks:
        detail = textwrap.wrap(c.detail, w_detail, break_long_words=True) or [""]
        action = textwrap.wrap(c.action, w_action, break_long_words=True) or [""]
        for i in range(max(len(detail), len(action))):
            d = detail[i] if i < len(detail) else ""
            a = action[i] if i < len(action) else ""
            first = i == 0
            lines.append(f"{c.check if first else '':<{w_check}}  {c.status if first else '':<{w_status}}"
                         f"  {d:<{w_detail}}  {a}".rstrip())
    return "\n".join(lines)


def summarize(checks: Sequence[Check]) -> dict[str, int]:
    return {s: sum(c.status == s for c in checks) for s in STATUSES}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="coldstart doctor",
        description="Check driver, CUDA, GPU visibility, context time, env vars, Triton's kernel "
                    "cache, weight-read speed, page cache and host->device bandwidth for a fast "
                    "replica start.",
        epilog="Exit code 0 when no check failed, 1 otherwise.")
    p.add_argument("--model", type=Path, default=None,
                   help=f"packed model directory (or any file/dir) to test (default {DEFAULT_MODEL_DIR})")
    p.add_argument("--read-gib", type=float, default=1.0,
                   help="read at most this many GiB of the model for the read test (default 1)")
    p.add_argument("--threads", type=int, default=8, help="reader threads (default 8)")
    p.add_argument("--drop-cache", action="store_true",
                   help="evict the model's clean pages first so the read test measures the disk")
    p.add_argument("--require-gpu", action="store_true",
                   help="fail, rather than skip, the GPU checks when no GPU is usable")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="also check this node for a tensor-parallel replica of N ranks: N GPUs, peer access "
                        "between them, an NCCL group's start")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = DoctorOptions(model=args.model or Path(DEFAULT_MODEL_DIR),
                             model_given=args.model is not None, read_gib=args.read_gib,
                             threads=args.threads, drop_cache=args.drop_cache,
                             require_gpu=args.require_gpu, tp=args.tp)
    except ValueError as e:
        print(f"coldstart doctor: {e}", file=sys.stderr)
        return 2
    checks = run_checks(opts)
    counts = summarize(checks)
    failed = counts["fail"] > 0
    if args.json:
        print(json.dumps({"ok": not failed, "summary": counts,
                          "checks": [asdict(c) for c in checks]}, indent=2, default=str))
    else:
        width = shutil.get_terminal_size((120, 24)).columns
        print(render_table(checks, width))
        print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
