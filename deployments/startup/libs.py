"""The cuBLAS libraries a replica's first GEMMs run from, read into the page cache early.

torch maps cuBLAS and cuBLASLt (``libcublas.so*``, ``libcublasLt.so*``: several hundred MB
together) when it is imported, but under CUDA_MODULE_LOADING=LAZY the kernels in them are read
only at their first use: on a node whose page cache is cold, the engine's first GEMMs fault the
libraries in from disk page by page, one small random read at a time (seen as a first decode
launch of 1.6 s on a new node). Reading the files once, sequentially and in large chunks, puts
them in the page cache at the disk's full rate; the faults then find their pages in memory.

``find`` locates the files without importing torch: in the lib folders of the installed
``nvidia`` pip packages (``nvidia/cublas/lib`` for CUDA 12's wheels, ``nvidia/cu13/lib`` for
CUDA 13's) and in ``torch/lib`` (builds that carry their own copy). ``prefetch`` reads them.
Neither touches the GPU, so the worker setup hook (``deployments.startup.early``) runs them
on a side thread beside Ray's start of the worker, where COLDSTART_PREFETCH_LIBS is on.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
import os
import time
from typing import Iterable

log = logging.getLogger(__name__)

# auditwheel renames a library a wheel bundles (libcublasLt-<hash>.so.12): both spellings count
PATTERNS = ("libcublas.so*", "libcublasLt.so*", "libcublas-*.so*", "libcublasLt-*.so*")
CHUNK = 8 << 20


def _package_dirs(name: str) -> list[str]:
    """Where package ``name`` lives (several folders for a namespace package such as ``nvidia``),
    found without importing it; none where it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or ()) if spec is not None else []


def lib_dirs(roots: Iterable[str] | None = None) -> list[str]:
    """The folders ``find`` looks in: each ``nvidia`` package's ``*/lib`` (``cublas/lib``,
    ``cu13/lib``, ...) and ``torch/lib``. ``roots``: folders that hold ``nvidia/`` and ``torch/``
    (a site-packages), instead of where this interpreter finds those packages."""
    if roots is None:
        nvidia, torch = _package_dirs("nvidia"), _package_dirs("torch")
    else:
        roots = list(roots)
        nvidia = [os.path.join(r, "nvidia") for r in roots]
        torch = [os.path.join(r, "torch") for r in roots]
    out = []
    for d in nvidia:
        try:
            subs = sorted(os.listdir(d))
        except OSError:
            continue
        out += [os.path.join(d, s, "lib") for s in subs if os.path.isdir(os.path.join(d, s, "lib"))]
    out += [os.path.join(d, "lib") for d in torch if os.path.isdir(os.path.join(d, "lib"))]
    return out


def find(roots: Iterable[str] | None = None) -> list[str]:
    """The cuBLAS and cuBLASLt shared libraries in ``lib_dirs(roots)``: real paths of regular
    files, each once however many symlinks name it, in the order found."""
    seen: dict[str, None] = {}
    for d in lib_dirs(roots):
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for n in names:
            if not any(fnmatch.fnmatchcase(n, p) for p in PATTERNS):
                continue
            real = os.path.realpath(os.path.join(d, n))
            if os.path.isfile(real):
                seen.setdefault(real)
    return list(seen)


def prefetch(paths: Iterable[str], chunk: int = CHUNK) -> dict:
    """Read each file from start to end into a reused buffer, so that its pages are in the page
    cache; {"files": files read to their end, "bytes": bytes read, "s": seconds taken}. A file
    that is missing or unreadable is skipped (logged at debug level): never raises for one."""
    t0 = time.perf_counter()
    buf = memoryview(bytearray(chunk))
    files = total = 0
    for p in paths:
        try:
            with open(p, "rb", buffering=0) as f:
                if hasattr(os, "posix_fadvise"):  # a larger read-ahead window; the reads below do the work
                    try:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except OSError:
                        pass
                while n := f.readinto(buf):
                    total += n
            files += 1
        except (OSError, ValueError) as e:
            log.debug("prefetch: skipped %s: %s", p, e)
    return {"files": files, "bytes": total, "s": round(time.perf_counter() - t0, 3)}
