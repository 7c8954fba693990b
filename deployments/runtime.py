"""Replica runtime set-up: pick the device, check it can work, create the CUDA context.

Runs first in the replica's constructor, so a wrong driver or an invisible GPU
fails the replica at once with a message that says what to fix, instead of a
hang or a CUDA error deep inside loading. The CUDA context is created first:
by the driver on a side thread while torch is imported (``start_context``), and
checked and timed here before anything else touches the GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

# the side thread of ``start_context`` and what it did: seconds, or why it did nothing
_EARLY: dict = {}


class PreflightError(RuntimeError):
    """The replica cannot run on this machine; the message says what to fix."""


def _visible() -> str:
    return (f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}, "
            f"NVIDIA_VISIBLE_DEVICES={os.environ.get('NVIDIA_VISIBLE_DEVICES', '<unset>')}")


def check_driver(proc_text: str | None, torch_cuda: str | None) -> str | None:
    """Raise ``PreflightError`` if the NVIDIA driver is too old for torch's CUDA build.

    ``proc_text`` is /proc/driver/nvidia/version (read without starting CUDA or
    nvidia-smi); returns the driver version, or None when it cannot be known.
    """
    from deployments.gpu_facts import driver_verdict, parse_proc_driver_version
    driver = parse_proc_driver_version(proc_text) if proc_text else None
    if driver is None or torch_cuda is None:
        return driver
    status, detail, action = driver_verdict(driver, torch_cuda)
    if status == "fail":
        raise PreflightError(f"{detail}; {action}")
    if status == "warn":
        log.warning("%s; %s", detail, action)
    return driver


def _proc_driver_text() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.read()
    except OSError:
        return None


def choose_device(requested: str):
    """Resolve ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` into a torch.device, or raise
    ``PreflightError`` when a GPU was asked for and cannot be used."""
    import torch

    if requested == "cpu":
        return torch.device("cpu")
    # before CUDA starts: a driver too old for this torch fails here with the versions,
    # not later as "no GPU" or a CUDA error
    check_driver(_proc_driver_text(), torch.version.cuda)
    if requested == "auto" and not torch.cuda.is_available():
        log.info("no GPU visible (%s): serving on the CPU", _visible())
        return torch.device("cpu")
    if torch.version.cuda is None:
        raise PreflightError(
            f"device={requested!r} but this torch ({torch.__version__}) is a CPU-only build; "
            "install a CUDA build of torch (see the Dockerfile)")
    if not torch.cuda.is_available():
        raise PreflightError(
            f"device={requested!r} but no GPU is usable ({_visible()}); check that the replica "
            "asks Ray for a GPU (ray_actor_options.num_gpus), that the NVIDIA driver is loaded, "
            f"and that it supports CUDA {torch.version.cuda} (run `coldstart doctor`)")
    n = torch.cuda.device_count()
    idx = 0 if requested in ("auto", "cuda") else int(requested.split(":", 1)[1])
    if idx >= n:
        raise PreflightError(f"device={requested!r} but only {n} GPU(s) are visible ({_visible()}); "
                             "inside Ray and Kubernetes the visible GPUs are renumbered from 0")
    return torch.device("cuda", idx)


def check_env() -> list[str]:
    """Warnings about start-up settings (the deployment's runtime_env should set them)."""
    warn = []
    if os.environ.get("CUDA_MODULE_LOADING", "LAZY") != "LAZY":
        warn.append("CUDA_MODULE_LOADING is not LAZY: context creation loads every kernel "
                    "(seconds); set it to LAZY in runtime_env.env_vars")
    return warn


def _driver_present() -> bool:
    return os.path.exists("/dev/nvidiactl")


def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def start_context(requested: str) -> threading.Thread | None:
    """Create the GPU's primary CUDA context on a side thread, through the driver itself,
    while this thread imports torch; None where it is not started.

    Creating a context is driver work that needs no torch, and a ctypes call holds no GIL, so
    it runs beside the import (on an H200 host, 0.30 s there, and the replica's ``context``
    phase took 0.02 s where the minimal replica's took 0.30-0.36 s in the same run,
    bench/results/serve.json). torch's runtime later finds the
    device's primary context there and uses it (the runtime API works in the primary
    context); ``create_context`` then only checks and times what is left. Only for the
    device torch will call 0 (``auto``, ``cuda``, ``cuda:0``; inside Ray, the replica's
    GPU), and where an NVIDIA driver is present. CUDA_MODULE_LOADING is set to LAZY first
    where it is unset, as torch does before its own first CUDA call: the driver reads it
    once, at cuInit. Env COLDSTART_EARLY_CONTEXT=0 turns this off. Imports nothing heavy."""
    if (requested not in ("auto", "cuda", "cuda:0") or _EARLY
            or os.environ.get("COLDSTART_EARLY_CONTEXT", "1") == "0" or not _driver_present()):
        return None
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")

    def run() -> None:
        t0 = time.perf_counter()
        try:
            cuda = _libcuda()
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            for call, rc in (("cuInit", lambda: cuda.cuInit(0)),
                             ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
                             ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
                code = rc()
                if code != 0:  # torch meets the same condition in create_context and says what to fix
                    _EARLY["skipped"] = f"{call} returned CUDA error {code}"
                    return
            _EARLY["seconds"] = time.perf_counter() - t0
        except (OSError, AttributeError) as e:  # no libcuda to load: torch's own start reports it
            _EARLY["skipped"] = str(e)

    t = threading.Thread(target=run, name="cuda-context", daemon=True)
    _EARLY["thread"] = t
    t.start()
    return t


def early_context(timeout: float = 60.0) -> float | None:
    """Wait for ``start_context``'s thread; the seconds it took to create the context on the
    side, or None where it did not (not started, or the driver refused: see the log)."""
    t = _EARLY.get("thread")
    if t is None:
        return None
    t.join(timeout)
    if "skipped" in _EARLY:
        log.info("CUDA context not created ahead: %s", _EARLY["skipped"])
    return _EARLY.get("seconds")


def create_context(device) -> dict:
    """Create the CUDA context on ``device`` now (no-op on CPU); returns facts for the log."""
    import torch

    if device.type != "cuda":
        return {"device": "cpu", "threads": torch.get_num_threads()}
    torch.cuda.set_device(device)
    torch.empty(1, device=device)  # the first allocation creates the primary context
    torch.cuda.synchronize(device)
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"device": str(device), "name": props.name, "cuda": torch.version.cuda,
            "free_gib": round(free / 2**30, 1), "total_gib": round(total / 2**30, 1)}


def device_error(device) -> str | None:
    """A cheap check that the GPU still works; the error text, or None when healthy."""
    if device.type != "cuda":
        return None
    import torch
    try:
        torch.cuda.synchronize(device)  # surfaces a sticky error from any earlier kernel
        torch.cuda.mem_get_info(device)
    except RuntimeError as e:
        return f"GPU error on {device}: {e}"
    return None


def process_start_time() -> float | None:
    """When this process started, as a Unix time (Linux /proc), or None elsewhere.

    The replica reports it so a start can be measured from the process's birth,
    before any Python import, not only from the constructor.
    """
    try:
        stat = open("/proc/self/stat").read()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        btime = next(int(l.split()[1]) for l in open("/proc/stat") if l.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
