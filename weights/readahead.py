"""The page cache and a packed model: read-ahead ahead of the loader, residency.

``prefetch(path)`` starts reading the weight file into the page cache and
returns at once. A replica calls it right after its imports, its CUDA context
and the loader's start (the device buffer and its tensor views), beside the
loader's own reads, so on a cold page cache the disk works ahead of the loader
while the engine is built. (Not before: a bulk read of the same disk starves
the page faults of the import, of the context and of the first uses of torch's
code on torch's and CUDA's libraries, which then end only when the read does;
bench/cold_import.py, bench/results/serve.json.)

One ``posix_fadvise(WILLNEED)`` over the whole file is not enough: Linux reads
at most max(read_ahead_kb, max_sectors_kb) per call (128 KiB to a few MiB), so
the hint is issued per 128 KiB piece, front to back. It runs in a small helper
process rather than a thread: the calls are cheap but there are ~100,000 of
them for a 13 GB file, and a thread would have to win the GIL back from the
import after every one. The kernel reads asynchronously; no data is copied.

``resident_bytes`` / ``resident_fraction`` say how much of a file is already
in the page cache (mincore(2)), so the loader can pick disk or memory settings
and ``coldstart doctor`` can report it. This module imports nothing heavy on
purpose.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

PIECE = 128 << 10  # read_ahead_kb's usual default: every call of this size is read whole

_HINTS = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
piece, limit = int(sys.argv[2]), int(sys.argv[3])
size = min(os.fstat(fd).st_size, limit)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
for off in range(0, size, piece):
    os.posix_fadvise(fd, off, piece, os.POSIX_FADV_WILLNEED)
"""

_started: dict[str, subprocess.Popen] = {}
_lock = threading.Lock()


def prefetch(path: str | os.PathLike) -> subprocess.Popen | None:
    """Start read-ahead of ``model.cst`` (or a packed directory's one) in the background.

    Returns the helper process (``wait()`` returns once every piece is queued;
    the reads themselves finish shortly after), or None where the file is
    missing or the platform has no ``posix_fadvise``. A second call for the
    same file in this process returns the first one's helper. At most half of
    the memory available now is read ahead (the front of the file).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "model.cst"
    if not p.is_file() or not hasattr(os, "posix_fadvise"):
        return None
    key = str(p.resolve())
    # read ahead no more than half the free memory: a file larger than that would push
    # its own first pages out before the loader got to them, and be read twice
    limit = p.stat().st_size if (avail := _available_memory()) is None else avail // 2
    with _lock:
        proc = _started.get(key)
        if proc is None:
            try:  # -I -S: no site packages, no environment: starts in ~10 ms
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _HINTS, key, str(PIECE), str(limit)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, close_fds=True)
            except OSError as e:
                log.warning("prefetch of %s skipped: %s", p, e)
                return None
            _started[key] = proc
    return proc


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
