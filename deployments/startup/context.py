"""The GPU's CUDA context, made by the driver on a side thread while torch is imported.

Creating a context is driver work that needs no torch, and a ctypes call holds no GIL, so it
runs beside ``import torch``. torch's runtime later finds the device's primary context made and
uses it (the runtime API works in the primary context); ``deployments.device.create_context``
then only checks and times what is left. Imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import os

from deployments.startup.side import SideTask

DRIVER_FILE = "/dev/nvidiactl"  # present where an NVIDIA driver is loaded
LIBCUDA = "libcuda.so.1"


def _make() -> str | None:
    """cuInit and the primary context of device 0; None, or why not (the driver's error code:
    torch meets the same condition in ``create_context`` and says what to fix)."""
    cuda = ctypes.CDLL(LIBCUDA)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for call, rc in (("cuInit", lambda: cuda.cuInit(0)),
                     ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
                     ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
        code = rc()
        if code != 0:
            return f"{call} returned CUDA error {code}"
    return None


def start(requested: str) -> SideTask | None:
    """Start making the context (``SideTask``: its ``result`` is None, or why it did not);
    None where it is not started. Only for the device torch will call 0 (``auto``, ``cuda``,
    ``cuda:0``; inside Ray, the replica's GPU) and where an NVIDIA driver is present.
    CUDA_MODULE_LOADING is set to LAZY first where it is unset, as torch does before its own
    first CUDA call: the driver reads it once, at cuInit."""
    if requested not in ("auto", "cuda", "cuda:0") or not os.path.exists(DRIVER_FILE):
        return None
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    return SideTask("cuda-context", _make)
