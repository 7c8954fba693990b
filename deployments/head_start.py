"""Triton's once-per-process set-up, on a side thread from a replica's first instant.

Before Triton's first launch can even look in its kernel cache, the process must
import Triton, hash Triton's own files and its 400 MB library into every cache key,
find libcuda, and make Triton's CUDA driver object, which loads (on a new node:
compiles) a C helper module and runs ``file`` on the Python executable to key it.
On an H200 host that was 0.22 s of import, 0.26 s of hashing and 0.48 s of driver
on the replica's main thread (bench/results/runs/start-profile.json). Hashing,
the compiler, the subprocesses and the module loads drop the GIL, so ``start``
runs them while the main thread imports torch; the first self-test of the kernels
calls ``wait``.

Neither Triton nor this module imports torch (``import torch`` on the side thread
waits for the main thread's); this module imports nothing heavy on purpose.
"""

from __future__ import annotations

import os
import threading

_THREADS: list[threading.Thread] = []


def wanted(device: str) -> bool:
    """Whether a replica on ``device`` ("auto", "cpu", "cuda[:N]") will launch Triton kernels
    (as far as can be told before importing torch)."""
    if os.environ.get("COLDSTART_TRITON", "1") == "0" or device == "cpu":
        return False
    return device.startswith("cuda") or os.path.exists("/dev/nvidiactl")  # auto: an NVIDIA driver is here


def start(device: str = "auto") -> threading.Thread | None:
    """Start the side thread (once per process); None where Triton will not be used."""
    if not wanted(device) or _THREADS:
        return None

    def run() -> None:
        try:  # Triton's internals: a release that moved them just gives no head start
            import triton  # noqa: F401
            from triton.runtime.cache import triton_key
            triton_key()
            from triton.backends.nvidia.driver import libcuda_dirs
            libcuda_dirs()
            import torch  # the main thread's import, once it is done
            if torch.cuda.is_available():  # no CUDA context is made here
                from triton.runtime.driver import driver
                driver.active  # noqa: B018 - made on first access
        except Exception:  # noqa: BLE001 - never fail a replica over a head start
            pass

    t = threading.Thread(target=run, name="triton-head-start", daemon=True)
    t.start()
    _THREADS.append(t)
    return t


def wait(timeout: float = 60.0) -> None:
    """Wait for ``start``'s thread, so that its work is not done twice."""
    for t in _THREADS:
        t.join(timeout)
