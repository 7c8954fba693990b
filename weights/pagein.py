"""The programs of ``weights.readahead``'s helper processes, one process per file::

    python -m weights.pagein hint PATH PIECE LIMIT      the kernel asked to read each PIECE, front to back
    python -m weights.pagein trickle PATH PIECE LIMIT   one read of PIECE at a time, read-ahead off

Both stop at LIMIT bytes (or the file's end). A process of its own, not a thread: there are ~100,000
hints for a 13 GB file, and a thread would have to win the GIL back from the replica's imports after
each. Standard library only: the helper starts without site packages.
"""

from __future__ import annotations

import os
import sys


def hint(fd: int, piece: int, size: int) -> None:
    """``posix_fadvise(WILLNEED)`` per ``piece``: Linux reads at most max(read_ahead_kb,
    max_sectors_kb) per call, so one hint over the whole file would read only its start. The
    kernel reads asynchronously; nothing is copied."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    for off in range(0, size, piece):
        os.posix_fadvise(fd, off, piece, os.POSIX_FADV_WILLNEED)


def trickle(fd: int, piece: int, size: int) -> None:
    """One read of ``piece`` at a time with the kernel's own read-ahead off for this descriptor
    (FADV_RANDOM): the disk's queue never holds more than one such request, so the page faults of
    an import beside it wait for at most one piece. Plain reads, even one at a time, let the
    kernel's read-ahead queue megabytes ahead of them. Ends early when the replica that started
    it is gone: nobody to read for."""
    parent = os.getppid()
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    buf = bytearray(piece)
    off = 0
    while off < size and os.getppid() == parent:
        n = os.preadv(fd, [buf], off)
        if n <= 0:
            break
        off += n


PROGRAMS = {"hint": hint, "trickle": trickle}


def main(argv: list[str]) -> None:
    program, path, piece, limit = argv
    fd = os.open(path, os.O_RDONLY)
    try:
        PROGRAMS[program](fd, int(piece), min(os.fstat(fd).st_size, int(limit)))
    finally:
        os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1:])
