"""Where a remote model's transfer spends its time on this host: each step of a piece apart.

    PYTHONPATH=$PWD python bench/transfer_steps.py --packed /tmp/coldstart-bench/packed \
        --out OUT/steps.json [--threads 16] [--dir DIR]

A transfer (``weights.fetch``) moves each 16 MiB piece of the weight file's data region through
these steps: a ranged GET into a staging slot, its chunk sums, a copy to the GPU, a write into the
node cache's one file. On a GPU the reader threads do the first and the copy to the device, the
device sums each piece, and writer threads write the cache's file behind them; on the CPU the
reader threads do all but the copy to the device. This measures each step over the whole data
region, ``--threads`` threads, 16 MiB pieces, all steps in the reader threads (the CPU's way, and
what the GPU's used to be):

writes    from memory, each on a fresh file in ``--dir`` (default: beside the node cache): ``pwrite``
          into one file (the cache's file), into one file per thread, into the one file mapped
          with each piece's pages faulted in at once, and with ``O_DIRECT`` (the disk itself).
compute   the chunk sums alone, and the copies alone, from memory.
pipeline  from a local source (bench/fetch.py's 16-process server on this host), a step added at a
          time, each entry with every step before it: ``reads`` (obstore's answers, dropped),
          ``copy`` (the transfer's own read into a staging slot, ``Origin.read_into``: straight
          into it, or obstore's answer copied where it cannot sign), ``sums`` (the chunk sums),
          ``gpu`` (the copy to the GPU, where there is one), ``pwrite`` (into one cache file);
          ``mapped``: the same with the copy into the cache file mapped instead of ``pwrite``.
Where a step's rate falls well below the one before it, that step is the transfer's limit here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.fetch import PIECE, _pieces, start_source  # noqa: E402
from bench.meta import commit  # noqa: E402

POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


def _timed(res: dict, name: str, nbytes: int, fn: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    fn()
    s = time.perf_counter() - t0
    res[name] = {"s": round(s, 3), "GBps": round(nbytes / s / 1e9, 3)}
    print(f"{name:34s} {res[name]['GBps']:8.2f} GB/s {s:7.2f} s", flush=True)


def _each_thread(threads: int, pieces: list[tuple[int, int]], fn: Callable[[int, int, int], None]) -> None:
    """``fn(thread, offset, length)`` for every piece, thread k taking pieces k, k + threads, ..."""
    def run(k: int) -> None:
        for off, n in pieces[k::threads]:
            fn(k, off, n)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(threads)))


def _fresh(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def _sized(path: Path, size: int) -> int:
    """``path`` opened and reserved whole, as a transfer's cache file is (``weights.fetch._allocate``)."""
    from weights.fetch import _allocate
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    _allocate(fd, size, path)
    return fd


@contextlib.contextmanager
def _mapped(path: Path, size: int) -> Iterator[Callable[[int, np.ndarray], None]]:
    """``path`` reserved and mapped; yields ``copy(at, src)``, which faults the pages of
    ``at..at+len(src)`` in at once (``MADV_POPULATE_WRITE``), then copies ``src`` there."""
    fd = _sized(path, size)
    mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    arr = np.frombuffer(mapped, np.uint8)

    def copy(at: int, src: np.ndarray) -> None:
        start = at - at % mmap.PAGESIZE
        mapped.madvise(POPULATE_WRITE, start, at + len(src) - start)
        np.copyto(arr[at:at + len(src)], src)
    try:
        yield copy
    finally:
        arr = None  # (the map's buffer let go, so that it can close)
        mapped.close()
        os.close(fd)


def writes(d: Path, size: int, pieces: list[tuple[int, int]], threads: int) -> dict:
    res: dict = {}
    bufs = [np.full(PIECE, k + 1, np.uint8) for k in range(threads)]
    fd = _sized(_fresh(d) / "one", size)
    _timed(res, "pwrite_one_file", size, lambda: _each_thread(
        threads, pieces, lambda k, off, n: os.pwrite(fd, memoryview(bufs[k])[:n], off)))
    os.close(fd)
    per = _fresh(d)
    fds = [os.open(per / f"t{k}", os.O_RDWR | os.O_CREAT, 0o644) for k in range(threads)]
    _timed(res, "pwrite_file_per_thread", size, lambda: _each_thread(
        threads, pieces, lambda k, off, n: os.pwrite(fds[k], memoryview(bufs[k])[:n], off)))
    for f in fds:
        os.close(f)
    with _mapped(_fresh(d) / "one", size) as copy:
        try:
            _timed(res, "mapped_populated_one_file", size, lambda: _each_thread(
                threads, pieces, lambda k, off, n: copy(off, bufs[k][:n])))
        except OSError as e:  # a kernel without MADV_POPULATE_WRITE
            res["mapped_populated_one_file"] = {"error": str(e)}
    try:
        fd = os.open(_fresh(d) / "direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:  # tmpfs and some others refuse O_DIRECT
        res["o_direct_one_file"] = {"error": str(e)}
    else:
        aligned = [mmap.mmap(-1, PIECE) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
        _timed(res, "o_direct_one_file", size, lambda: _each_thread(
            threads, pieces, lambda k, off, n: os.pwrite(fd, memoryview(aligned[k])[:-(-n // 4096) * 4096], off)))
        os.close(fd)
    shutil.rmtree(d, ignore_errors=True)
    return res


def compute(size: int, pieces: list[tuple[int, int]], threads: int, chunk_bytes: int) -> dict:
    from weights import checksum
    from weights.remote import copy_into
    res: dict = {}
    src = [np.full(PIECE, 7, np.uint8) for _ in range(threads)]
    dst = [np.empty(PIECE, np.uint8) for _ in range(threads)]
    _timed(res, "chunk_sums", size, lambda: _each_thread(
        threads, pieces, lambda k, off, n: checksum.chunk_sums_host(src[k][:n], chunk_bytes)))
    _timed(res, "copies", size, lambda: _each_thread(
        threads, pieces, lambda k, off, n: copy_into(memoryview(dst[k])[:n], memoryview(src[k])[:n])))
    return res


def pipeline(packed: Path, uri: str, d: Path, threads: int) -> dict:
    import obstore
    import torch

    from weights import checksum, stream
    from weights.format import read_packed
    from weights.remote import Origin, Timeouts
    pf = read_packed(packed)
    pieces = _pieces(packed)  # (offset in the file, length)
    size, base = pf.data_bytes, pf.data_offset
    origin, rel = Origin(uri, Timeouts()), "model.cst"
    gpu = torch.cuda.is_available()
    if gpu:
        dev = torch.device("cuda", 0)
        dest = torch.empty(size, dtype=torch.uint8, device=dev)
        rt = stream.cudart()
        slots = [stream.Slots(rt, dev, dest, 2, PIECE) for _ in range(threads)]
        views = [s.views for s in slots]
    else:
        views = [[memoryview(np.empty(PIECE, np.uint8)) for _ in range(2)] for _ in range(threads)]
    turn = [0] * threads
    res: dict = {}

    def step(copy: bool = False, check: bool = False, h2d: bool = False,
             write: Callable[[memoryview, int, int], None] | None = None) -> Callable[[int, int, int], None]:
        def one(k: int, at: int, n: int) -> None:
            if not copy:  # the reply received and dropped (the origin's own store: no copy out of it)
                obstore.get_range(origin._store, rel, start=at, length=n)
                return
            s = turn[k] % 2
            turn[k] += 1
            if gpu:
                slots[k].wait(s)
            v = views[k][s][:n]
            origin.read_into(rel, at, v)
            if check:
                checksum.chunk_sums_host(np.frombuffer(v, np.uint8), pf.index.chunk_bytes)
            if write is not None:
                write(v, at, n)
            if h2d and gpu:
                slots[k].copy(s, at - base, n)
        return one

    def run(name: str, fn: Callable[[int, int, int], None]) -> None:
        def whole() -> None:
            _each_thread(threads, pieces, fn)
            if gpu:
                for s in slots:
                    s.wait(0)
                    s.wait(1)
        _timed(res, name, size, whole)

    _each_thread(threads, pieces[:threads], step())  # connections, and the source's page cache
    run("reads", step())
    run("copy", step(copy=True))
    run("sums", step(copy=True, check=True))
    if gpu:
        run("gpu", step(copy=True, check=True, h2d=True))
    fd = _sized(_fresh(d) / "cache", pf.file_bytes)
    run("pwrite", step(copy=True, check=True, h2d=True, write=lambda v, at, n: os.pwrite(fd, v, at)))
    os.close(fd)
    with _mapped(_fresh(d) / "cache", pf.file_bytes) as copy:
        try:
            run("mapped", step(copy=True, check=True, h2d=True,
                               write=lambda v, at, n: copy(at, np.frombuffer(v, np.uint8))))
        except OSError as e:
            res["mapped"] = {"error": str(e)}
    shutil.rmtree(d, ignore_errors=True)
    if gpu:
        for s in slots:
            s.close()
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", required=True, help="a packed model directory (its model.cst is the subject)")
    ap.add_argument("--out", required=True, help="the result file (JSON)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--dir", help="where the write steps' files go (default: beside the node cache)")
    a = ap.parse_args(argv)
    import torch

    from deployments.node_cache import model_cache
    from weights.format import read_packed
    packed = Path(a.packed)
    pf = read_packed(packed)
    d = Path(a.dir) if a.dir else model_cache().root.parent / "coldstart-transfer-steps"
    size = pf.data_bytes
    pieces = [(o, min(PIECE, size - o)) for o in range(0, size, PIECE)]
    out = {"host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "commit": commit(),
           "packed": str(packed), "bytes": size, "threads": a.threads, "piece_mib": PIECE >> 20, "dir": str(d),
           "cores": os.cpu_count()}
    out["writes"] = writes(d, size, pieces, a.threads)
    out["compute"] = compute(size, pieces, a.threads, pf.index.chunk_bytes)
    server, uri = start_source(packed)
    try:
        out["pipeline"] = pipeline(packed, uri, d, a.threads)
    finally:
        server.terminate()
        server.wait(timeout=30)
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
