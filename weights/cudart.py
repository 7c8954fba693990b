"""The few CUDA runtime calls the load path (and the engine's graph upload) makes,
straight through ctypes.

Why not torch: each piece of a load is a read, a host->device copy and an
event; through torch every copy and event holds the GIL for tens of
microseconds of dispatch, and with 16 reader threads and ~1600 pieces for a
7B model that serialises into a tenth of a second. A ctypes call releases
the GIL for the whole foreign call, so the threads' reads, copies and waits
overlap freely. We bind the libcudart that torch itself loaded (found in
/proc/self/maps), so the version always matches torch's. Where it cannot be
found (a statically linked build), ``CudaRT.find()`` returns None and the
loader uses torch's own calls, saying so in the log.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

_H2D = 1                  # cudaMemcpyHostToDevice
_D2H = 2                  # cudaMemcpyDeviceToHost
_EVENT_NO_TIMING = 0x2    # cudaEventDisableTiming: cheapest event to record and wait on


class CudaError(RuntimeError):
    pass


class CudaRT:
    """Thin wrapper over a loaded libcudart; every call checks its return code."""

    _shared: "CudaRT | None" = None

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib, self.path = lib, path
        c = ctypes
        sigs = {
            "cudaSetDevice": [c.c_int],
            "cudaHostAlloc": [c.POINTER(c.c_void_p), c.c_size_t, c.c_uint],
            "cudaFreeHost": [c.c_void_p],
            "cudaMemcpyAsync": [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p],
            "cudaEventCreateWithFlags": [c.POINTER(c.c_void_p), c.c_uint],
            "cudaEventRecord": [c.c_void_p, c.c_void_p],
            "cudaEventSynchronize": [c.c_void_p],
            "cudaEventDestroy": [c.c_void_p],
            "cudaGraphUpload": [c.c_void_p, c.c_void_p],
            "cudaGetErrorString": [c.c_int],
        }
        for name, args in sigs.items():
            f = getattr(lib, name)
            f.argtypes = args
            f.restype = c.c_char_p if name == "cudaGetErrorString" else c.c_int

    @classmethod
    def shared(cls) -> "CudaRT | None":
        """``find()``'s answer, bound once per process and shared by its users (the loader's
        copies, the engine's graph upload); a None is not kept, so a call before CUDA is
        initialised does not hide the library from a later one."""
        if cls._shared is None:
            cls._shared = cls.find()
        return cls._shared

    @classmethod
    def find(cls) -> "CudaRT | None":
        """The libcudart torch loaded, or None (call after CUDA is initialised)."""
        try:
            maps = Path("/proc/self/maps").read_text().splitlines()
        except OSError:
            return None
        paths = sorted({l.split()[-1] for l in maps if "/libcudart.so" in l})
        if not paths:
            return None
        try:
            return cls(ctypes.CDLL(paths[0]), paths[0])
        except (OSError, AttributeError) as e:
            log.warning("cannot bind %s (%s)", paths[0], e)
            return None

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.cudaGetErrorString(rc).decode(errors="replace")
            raise CudaError(f"{what} failed: CUDA error {rc} ({msg})")

    def set_device(self, index: int) -> None:
        self._check(self.lib.cudaSetDevice(index), "cudaSetDevice")

    def host_alloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self._check(self.lib.cudaHostAlloc(ctypes.byref(p), nbytes, 0), f"cudaHostAlloc({nbytes})")
        return p.value

    def free_host(self, ptr: int) -> None:
        self._check(self.lib.cudaFreeHost(ptr), "cudaFreeHost")

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, _H2D, stream), "cudaMemcpyAsync")

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, _D2H, stream), "cudaMemcpyAsync")

    def event(self) -> int:
        e = ctypes.c_void_p()
        self._check(self.lib.cudaEventCreateWithFlags(ctypes.byref(e), _EVENT_NO_TIMING),
                    "cudaEventCreate")
        return e.value

    def record(self, event: int, stream: int) -> None:
        self._check(self.lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def wait(self, event: int) -> None:
        self._check(self.lib.cudaEventSynchronize(event), "cudaEventSynchronize")

    def destroy(self, event: int) -> None:
        self._check(self.lib.cudaEventDestroy(event), "cudaEventDestroy")

    def graph_upload(self, graph_exec: int, stream: int) -> None:
        """Upload an instantiated CUDA graph to the device now (else its first launch does)."""
        self._check(self.lib.cudaGraphUpload(graph_exec, stream), "cudaGraphUpload")


def host_view(ptr: int, nbytes: int) -> memoryview:
    """A writable memoryview over ``nbytes`` of host memory at ``ptr``."""
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
