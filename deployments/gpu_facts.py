"""What the driver, the CUDA runtime and the environment say about this machine's GPUs.

Pure parsers and verdicts (testable on any machine) plus cheap probes that start
no CUDA context: ``nvidia-smi``, /proc/driver/nvidia/version, libcuda's
cuDriverGetVersion, the libraries mapped into this process. ``coldstart doctor``
turns them into checks; the replica's preflight (``deployments.device``) uses
the driver verdict to fail fast.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

PROC_DRIVER_VERSION = "/proc/driver/nvidia/version"

# Minimum Linux x86_64 driver for each CUDA toolkit, from NVIDIA's CUDA Toolkit
# Release Notes, table "CUDA Toolkit and Corresponding Driver Versions"
# (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html), and the
# minor-version-compatibility floor per major release from "CUDA Minor Version
# Compatibility" (https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html):
# below the toolkit's own driver but at or above the floor, a CUDA 11+/12+/13+
# program still runs, with a limited feature set (no PTX JIT of newer PTX).
TOOLKIT_MIN_DRIVER: dict[str, str] = {
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}
MINOR_COMPAT_MIN_DRIVER: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580"}


def _vtuple(version: str) -> tuple[int, ...]:
    """'570.86.15' -> (570, 86, 15); compare driver versions as tuples of ints."""
    return tuple(int(p) for p in re.findall(r"\d+", version))


@dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_mib: int | None


def parse_nvidia_smi(text: str) -> tuple[str | None, list[GpuInfo]]:
    """Parse `nvidia-smi --query-gpu=index,uuid,driver_version,name,memory.total
    --format=csv,noheader,nounits` output: (driver version, GPUs)."""
    driver, gpus = None, []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        index, uuid, drv, name, mem = parts[:5]
        driver = driver or drv
        gpus.append(GpuInfo(int(index), name, uuid, int(mem) if mem.isdigit() else None))
    return driver, gpus


def parse_proc_driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's NVRM line (proprietary or open module)."""
    m = re.search(r"NVRM version:.*?Kernel Module\S*(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def probe_driver() -> tuple[str | None, list[GpuInfo], str]:
    """(driver version, GPUs nvidia-smi lists, where the version came from)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "index,uuid,driver_version,name,memory.total"
        try:
            out = subprocess.run(
                [smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout
            driver, gpus = parse_nvidia_smi(out)
            if driver:
                return driver, gpus, "nvidia-smi"
        except (subprocess.SubprocessError, OSError, ValueError):
            pass  # fall through to /proc, which needs no working NVML
    try:
        text = Path(PROC_DRIVER_VERSION).read_text()
    except OSError:
        return None, [], "none"
    return parse_proc_driver_version(text), [], PROC_DRIVER_VERSION


def driver_verdict(driver: str, cuda: str) -> tuple[str, str, str]:
    """(status, detail, action) for an installed driver against torch's CUDA version."""
    key = ".".join(cuda.split(".")[:2])
    major = int(key.split(".")[0])
    floor = MINOR_COMPAT_MIN_DRIVER.get(major)
    known = [k for k in TOOLKIT_MIN_DRIVER if _vtuple(k) <= _vtuple(key) and _vtuple(k)[0] == major]
    full = TOOLKIT_MIN_DRIVER[max(known, key=_vtuple)] if known else None
    if floor is None:
        return ("warn", f"driver {driver}; no minimum known for CUDA {cuda}",
                "check NVIDIA's CUDA release notes for the driver this CUDA needs")
    if _vtuple(driver) < _vtuple(floor):
        return ("fail", f"driver {driver} is older than {floor}, the least any CUDA {major}.x "
                f"build (torch is built for CUDA {cuda}) runs on: CUDA will not initialise",
                f"install driver >= {full or floor}, or a torch wheel built for an older CUDA")
    if full and _vtuple(driver) < _vtuple(full):
        return ("warn", f"driver {driver} runs CUDA {cuda} only through minor-version "
                f"compatibility (CUDA {key} ships with {full})",
                f"upgrade the driver to >= {full} for the full feature set")
    return "ok", f"driver {driver} >= {full or floor} needed by torch's CUDA {cuda}", ""


def _loaded_libraries(pattern: str) -> list[str]:
    """Paths of shared objects mapped into this process whose name matches `pattern`."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines()
                   if "/" in line and re.search(pattern, line.rsplit("/", 1)[-1])})


def _runtime_wheel_version() -> str | None:
    from importlib import metadata

    for dist in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12",
                 "nvidia-cuda-runtime-cu11"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def driver_cuda_version() -> int | None:
    """cuDriverGetVersion() from libcuda (e.g. 13000): the newest CUDA the driver speaks.
    Needs no context, so it does not disturb the context timing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else None


def visibility_verdict(env: Mapping[str, str], listed: Sequence[GpuInfo],
                       torch_count: int | None) -> tuple[str, str, str]:
    """Explain which GPUs this process sees and why. Pure: env + what was probed.

    The trap: inside a container GPUs are numbered from 0. In Kubernetes the
    device plugin puts the *host's* index (or UUID) of the granted GPU in
    NVIDIA_VISIBLE_DEVICES, e.g. "3"; in the container that GPU is cuda:0.
    Feeding the host index to torch.cuda.set_device or CUDA_VISIBLE_DEVICES
    picks a GPU that does not exist there ("invalid device ordinal", or no GPU).
    Ray sets CUDA_VISIBLE_DEVICES per replica in the numbering the raylet sees,
    so a replica always uses cuda:0.
    """
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    nvd = env.get("NVIDIA_VISIBLE_DEVICES")
    in_k8s = "KUBERNETES_SERVICE_HOST" in env
    parts = [f"CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset",
             f"NVIDIA_VISIBLE_DEVICES={nvd!r}" if nvd is not None else "NVIDIA_VISIBLE_DEVICES unset"]
    if in_k8s:
        parts.append("in Kubernetes")
    if listed:
        parts.append(f"nvidia-smi lists {len(listed)} GPU(s) (container numbering 0..{len(listed) - 1})")
    if torch_count is not None:
        parts.append(f"torch sees {torch_count}")
    seen = "; ".join(parts)
    if cvd is not None:
        entries = [e.strip() for e in cvd.split(",") if e.strip()]
        if not entries or entries[0] in ("-1", "NoDevFiles"):
            if listed:
                return ("warn", f"CUDA_VISIBLE_DEVICES hides every GPU ({seen})",
                        "unset CUDA_VISIBLE_DEVICES, or give the replica num_gpus so Ray sets it")
        elif listed and all(e.isdigit() for e in entries):
            bad = [e for e in entries if int(e) >= len(listed)]
            if bad:
                return ("fail", f"CUDA_VISIBLE_DEVICES names GPU {','.join(bad)} but only indices "
                        f"0..{len(listed) - 1} exist here: that is the host's numbering; inside a "
                        f"container GPUs are numbered from 0 ({seen})",
                        "do not copy host indices (or NVIDIA_VISIBLE_DEVICES) into "
                        "CUDA_VISIBLE_DEVICES; unset it and use cuda:0")
    if in_k8s and nvd == "all":
        return ("warn", f"NVIDIA_VISIBLE_DEVICES=all in Kubernetes: unless the device plugin "
                f"replaced it, this pod sees every GPU of the node ({seen})",
                "request nvidia.com/gpu in the pod's limits; set NVIDIA_VISIBLE_DEVICES=void on "
                "pods that need none")
    if in_k8s and nvd and nvd not in ("all", "none", "void"):
        note = (f"the device plugin granted host GPU {nvd}; inside this container it is cuda:0 "
                "(never pass the host index to torch.cuda.set_device)")
        return "ok", f"{note} ({seen})", ""
    if torch_count == 0 and listed:
        return ("fail", f"the driver lists GPUs but torch sees none ({seen})",
                "check CUDA_VISIBLE_DEVICES and that the torch build matches the driver")
    return "ok", seen, ""
