"""The page cache and a packed model: read-ahead before torch is imported, residency.

``prefetch(path)`` asks the kernel (``posix_fadvise(WILLNEED)``) to start
reading the weight file into the page cache, from a background thread, and
returns at once. A replica calls it first thing, so on a cold page cache the
disk already works while Python spends seconds importing torch and creating
the CUDA context. ``resident_bytes`` / ``resident_fraction`` say how much of a
file is already in the page cache (mincore(2)), so the loader can pick disk or
memory settings and ``coldstart doctor`` can report it. This module imports
nothing heavy on purpose.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def prefetch(path: str | os.PathLike) -> threading.Thread | None:
    """Start read-ahead of ``model.cst`` (or a packed directory's one) in the background.

    Returns the thread (join it to wait for the hint to be issued), or None
    where the file is missing or the platform has no ``posix_fadvise``.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "model.cst"
    if not p.is_file() or not hasattr(os, "posix_fadvise"):
        return None

    def run() -> None:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError as e:
            log.warning("prefetch of %s skipped: %s", p, e)
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError as e:
            log.warning("prefetch of %s skipped: %s", p, e)
        finally:
            os.close(fd)

    t = threading.Thread(target=run, name="coldstart-prefetch", daemon=True)
    t.start()
    return t


_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        lib = ctypes.CDLL(name, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc = lib
    return _libc


# translate table: each mincore byte -> its residency bit (the other bits are reserved)
_LOW_BIT = bytes(b & 1 for b in range(256))


def resident_bytes(path: Path, offset: int = 0, length: int | None = None) -> int | None:
    """How many bytes of `path[offset:offset+length]` are in the page cache, via
    mincore(2) on a fresh read-only mapping (mapping does not fault pages in).
    None where mincore or mmap is not available (non-Linux, some sandboxes)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = _load_libc()
    if libc is None:
        return None
    size = path.stat().st_size
    length = size - offset if length is None else min(length, size - offset)
    if length <= 0:
        return 0
    page = mmap.PAGESIZE
    start = offset - offset % page
    span = offset + length - start
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            npages = (span + page - 1) // page
            vec = (ctypes.c_ubyte * npages)()
            if libc.mincore(ctypes.c_void_p(addr), span, vec) != 0:
                return None
            resident = bytes(vec).translate(_LOW_BIT).count(1)
        finally:
            libc.munmap(ctypes.c_void_p(addr), span)
    finally:
        os.close(fd)
    return min(resident * page, length)


def resident_fraction(path: Path, offset: int = 0, length: int | None = None,
                      samples: int = 32, window: int = 64 << 10) -> float | None:
    """Fraction of ``path[offset:offset+length]`` in the page cache, from ``samples``
    windows spread over it (tens of microseconds for any size); None if unknown."""
    size = path.stat().st_size
    length = size - offset if length is None else min(length, size - offset)
    if length <= 0:
        return None
    step = max(length // samples, 1)
    got = want = 0
    for i in range(0, length, step):
        n = min(window, length - i)
        r = resident_bytes(path, offset + i, n)
        if r is None:
            return None
        got, want = got + r, want + n
    return got / want if want else None
