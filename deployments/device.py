"""The replica's device: pick it, check it can work, create and check its CUDA context.

Runs first in the replica's start, so a wrong driver or an invisible GPU fails the replica
at once with a message that says what to fix, instead of a hang or a CUDA error deep inside
loading. Imports torch only inside the functions that need it.
"""

from __future__ import annotations

import logging
import os

from deployments import envs

log = logging.getLogger(__name__)

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


def gpu_expected(device: str) -> bool:
    """Whether a replica on ``device`` ("auto", "cpu", "cuda[:N]") will run on a GPU, as far as
    can be told without calling CUDA: a GPU asked for, or (auto) an NVIDIA driver's device file."""
    if device == "cpu":
        return False
    return device.startswith("cuda") or os.path.exists("/dev/nvidiactl")


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
    if envs.read("CUDA_MODULE_LOADING") != "LAZY":
        warn.append("CUDA_MODULE_LOADING is not LAZY: context creation loads every kernel "
                    "(seconds); set it to LAZY in runtime_env.env_vars")
    return warn


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
