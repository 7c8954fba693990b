"""Triton's once-per-process set-up, on a side thread from the start of a replica's constructor.

Before Triton's first launch can even look in its kernel cache, the process must import
Triton, hash Triton's own files and its library into every cache key (``triton_key``), find
libcuda, and make Triton's CUDA driver object, which loads (on a new node: compiles) a C
helper module. Hashing, the compiler, the subprocesses and the module loads drop the GIL, so
``start`` runs them while the main thread imports torch and makes the context; the replica's
start waits for it (``SideTask.wait``) before the first Triton launch. The driver object
itself asks torch whether CUDA is available, so it waits for the main thread's
``import torch``; nothing here makes a CUDA context.

Neither Triton nor this module imports torch at the top (``import torch`` on the side thread
waits for the main thread's); this module imports nothing heavy on purpose.
"""

from __future__ import annotations

from deployments import envs
from deployments.device import gpu_expected
from deployments.startup.side import SideTask


def wanted(device: str) -> bool:
    """Whether a replica on ``device`` will launch Triton kernels (a GPU expected, and
    COLDSTART_TRITON not 0)."""
    return envs.read("COLDSTART_TRITON") and gpu_expected(device)


def _setup() -> None:
    import triton  # noqa: F401
    from triton.runtime.cache import triton_key
    triton_key()  # the hash of Triton's sources and library, cached for the process (functools)
    from triton.backends.nvidia.driver import CudaUtils, libcuda_dirs
    libcuda_dirs()
    CudaUtils()  # the driver's C helper (a singleton): needs neither torch nor a context
    try:  # what Triton's first launcher imports
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401
    except ImportError:  # a Triton without it does not import it either
        pass
    import torch  # the main thread's import, once it is done
    if torch.cuda.is_available():  # no CUDA context is made here
        from triton.runtime.driver import driver
        driver.active  # noqa: B018 - made on first access


def start(device: str) -> SideTask | None:
    """Start the set-up on a side thread; None where Triton will not be used. A Triton whose
    internals moved just gives no head start (its error is logged)."""
    return SideTask("triton-setup", _setup) if wanted(device) else None
