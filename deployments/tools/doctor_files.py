"""`coldstart doctor`'s checks of what a node keeps on disk: the weights (their page-cache
residency and read speed), Triton's kernel cache and the compiled Python modules."""

from __future__ import annotations

import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Sequence

from deployments import envs
from deployments.node_cache import triton_cache_dir
from deployments.tools.check import GIB, READ_WARN_GBPS, WEIGHTS_FILE, Check, DoctorOptions
from weights.readahead import resident_bytes


# ---------------------------------------------------------------- weights files
def model_files(model: Path) -> list[Path]:
    """The packed file if there is one (a split pack's: every rank's), else every regular file under
    `model` (a file is itself)."""
    if model.is_file():
        return [model]
    packed = model / WEIGHTS_FILE
    if packed.is_file():
        return [packed]
    ranks = sorted(model.glob(f"rank-*/{WEIGHTS_FILE}"))  # a split pack: every rank's file
    if ranks and (model / "tp.json").is_file():
        return ranks
    return sorted(p for p in model.rglob("*") if p.is_file() and not p.is_symlink())


# mincore(2) residency lives with the read-ahead hint, which the loader also uses


def page_cache_fraction(paths: Sequence[Path], limit: int | None = None) -> float | None:
    """Fraction of the first `limit` bytes of `paths` (all of them if None) that is in
    the page cache; None when unknown (mincore unavailable) or there is nothing to read."""
    total = resident = 0
    for p in paths:
        size = p.stat().st_size
        n = size if limit is None else max(0, min(size, limit - total))
        if n == 0:
            continue
        r = resident_bytes(p, 0, n)
        if r is None:
            return None
        total, resident = total + n, resident + r
    return resident / total if total else None


def check_page_cache(opts: DoctorOptions, files: list[Path]) -> Check:
    name = "page cache"
    if not files:
        return Check(name, "skip", f"no files under {opts.model}")
    size = sum(p.stat().st_size for p in files)
    frac = page_cache_fraction(files)
    data = {"fraction": frac, "bytes": size, "files": [str(p) for p in files]}
    if frac is None:
        return Check(name, "skip", "unknown: mincore(2) is not available here", "", data)
    detail = (f"{frac:.0%} of {_names(files)} ({frac * size / 1e9:.2f} of {size / 1e9:.2f} GB) is in "
              "the page cache")
    action = ("" if frac > 0.9 else "a replica started now reads the rest from disk; pre-warm with "
              "`cat model.cst > /dev/null` or vmtouch -t after syncing the weights")
    return Check(name, "ok", detail, action, data)


def _names(files: Sequence[Path]) -> str:
    return files[0].name if len(files) == 1 else f"{len(files)} files"


def read_files(paths: Sequence[Path], limit: int, threads: int = 8,
               chunk: int = 16 << 20) -> tuple[int, float]:
    """Read the first `limit` bytes of `paths` with `threads` threads, os.preadv into one
    reused `chunk`-sized buffer per thread (never a whole-file buffer). (bytes, seconds)."""
    jobs: list[tuple[Path, int, int]] = []  # (file, offset, length)
    left = limit
    for p in paths:
        size = min(p.stat().st_size, left)
        jobs += [(p, off, min(chunk, size - off)) for off in range(0, size, chunk)]
        left -= size
        if left <= 0:
            break
    fds = {p: os.open(p, os.O_RDONLY) for p in {j[0] for j in jobs}}
    # one buffer per thread, allocated and touched (bytearray zero-fills) before the
    # clock starts, so page faults on fresh anonymous memory are not timed as I/O
    free = queue.SimpleQueue()
    for _ in range(min(threads, max(1, len(jobs)))):
        free.put(bytearray(chunk))

    def work(job: tuple[Path, int, int]) -> int:
        p, off, n = job
        buf = free.get()
        try:
            done = 0
            while done < n:  # preadv may return short
                got = os.preadv(fds[p], [memoryview(buf)[: n - done]], off + done)
                if got == 0:
                    raise OSError(f"{p}: unexpected end of file at byte {off + done}")
                done += got
            return done
        finally:
            free.put(buf)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            n = sum(pool.map(work, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
    return n, time.perf_counter() - t0


def drop_page_cache(files: Sequence[Path]) -> None:
    """Evict `files`' pages (POSIX_FADV_DONTNEED): needs no root, unlike drop_caches. Dirty
    pages are written first (fsync), since DONTNEED only drops clean ones."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def check_read_speed(opts: DoctorOptions, files: list[Path]) -> Check:
    name = "read speed"
    if not files:
        return Check(name, "skip", f"no files under {opts.model}")
    limit = int(opts.read_gib * GIB)
    before = page_cache_fraction(files, limit)
    n, secs = read_files(files, limit, opts.threads)
    gbps = n / secs / 1e9 if secs > 0 else float("inf")
    source = ("unknown source (mincore unavailable)" if before is None else
              "page cache" if before >= 0.9 else "disk" if before <= 0.1 else
              f"mixed ({before:.0%} page cache)")
    data = {"bytes": n, "seconds": round(secs, 4), "gbps": round(gbps, 3), "threads": opts.threads,
            "cached_fraction_before": before, "source": source}
    detail = (f"{n / 1e9:.2f} GB of {_names(files)} in {secs:.2f} s with {opts.threads} threads: "
              f"{gbps:.2f} GB/s from {source}")
    if n < 256 << 20:
        detail += " (under 256 MB: too little for a stable figure)"
    if gbps < READ_WARN_GBPS and n >= 256 << 20:
        if source == "page cache":
            return Check(name, "warn", detail, "page-cache reads are bound by CPU and memory: give "
                         "the replica more CPUs or raise --threads", data)
        return Check(name, "warn", detail, "put the weights on local NVMe, not network storage; "
                     "check that nothing else saturates the disk (iostat -x 1)", data)
    return Check(name, "ok", detail, "" if source != "page cache" else
                 "page-cache speed; --drop-cache measures the disk (evicts this file's pages)", data)


# ---------------------------------------------------------------- Triton's kernel cache
def mount_of(path: Path, mounts: str) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount holding ``path``, from /proc/mounts text."""
    best: tuple[str, str] | None = None
    p = str(path)
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = p == point or p.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best[0])):
            best = (point, parts[2])
    return best


def kernel_cache_verdict(path: Path, kernels: int, nbytes: int, writable: bool,
                         fstype: str | None) -> tuple[str, str, str]:
    """Judge Triton's cache directory: whether a replica's start finds its kernels compiled."""
    where = f"{path} ({kernels} compiled kernel groups, {nbytes / 2**20:.0f} MiB)"
    if not writable:
        return ("warn", f"{where} is not writable: every replica start compiles the decode kernels again "
                "(3-4 s more for a 7B on an H200)",
                "point TRITON_CACHE_DIR at a writable directory that outlives the container")
    if fstype == "overlay":
        return ("warn", f"{where} is on the container's own filesystem: a new container compiles the "
                "decode kernels again (3-4 s more for a 7B on an H200)",
                "mount a volume at TRITON_CACHE_DIR (the image uses /var/cache/coldstart/triton)")
    if kernels == 0:
        return ("ok", f"{where}: empty; the next start on this node compiles the decode kernels once "
                "(3-4 s more for a 7B on an H200) and later starts reuse them", "")
    return "ok", where, ""


def check_kernel_cache(opts: DoctorOptions, torch: ModuleType) -> Check:
    name = "kernel cache"
    import importlib.util
    if not envs.read("COLDSTART_TRITON"):
        return Check(name, "skip", "COLDSTART_TRITON=0: the decode step runs torch kernels; nothing to compile")
    if importlib.util.find_spec("triton") is None:
        return Check(name, "skip", "Triton is not installed: the decode step runs torch kernels (slower "
                     "per token); not checked", "install triton (torch's Linux CUDA wheels depend on it)")
    if torch is None or torch.version.cuda is None or not torch.cuda.is_available():
        return Check(name, "skip", "no usable CUDA device: the decode kernels are compiled on a GPU only; "
                     "not checked")
    d = triton_cache_dir()
    groups = [p for p in d.iterdir() if p.is_dir()] if d.is_dir() else []
    nbytes = sum(f.stat().st_size for g in groups for f in g.iterdir() if f.is_file())
    existing = next((p for p in (d, *d.parents) if p.exists()), Path("/"))
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        mounts = ""
    mount = mount_of(existing.resolve(), mounts)
    status, detail, action = kernel_cache_verdict(d, len(groups), nbytes, os.access(existing, os.W_OK),
                                                  mount[1] if mount else None)
    return Check(name, status, detail, action, {"dir": str(d), "kernel_groups": len(groups), "bytes": nbytes,
                                                "filesystem": mount[1] if mount else None})


def check_bytecode() -> Check:
    """Whether every replica compiles the modules it imports (no .pyc it can read or write),
    and if so where replicas keep them instead (``deployments.startup.bytecode``)."""
    name = "compiled modules"
    from deployments.startup import bytecode
    if sys.pycache_prefix is not None:
        return Check(name, "ok", f"PYTHONPYCACHEPREFIX={sys.pycache_prefix}: the interpreter's own cache")
    if not bytecode.needed():
        return Check(name, "ok", "the interpreter finds or writes torch's .pyc files itself")
    why = ("PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "torch's directory is not writable")
    where = bytecode.cache_dir()
    if where is None:
        return Check(name, "warn", f"torch is installed without .pyc files and {why}: every replica compiles "
                     "the modules it imports (some 770 of torch's alone), and the replicas' own "
                     "cache for them is turned off",
                     "unset COLDSTART_BYTECODE_CACHE=0, or install the "
                     "packages with their .pyc files (pip compiles them unless --no-compile)", {"dir": None})
    existing = next((p for p in (Path(where), *Path(where).parents) if p.exists()), Path("/"))
    files = sum(1 for _ in Path(where).rglob("*.pyc")) if Path(where).is_dir() else 0
    data = {"dir": where, "pyc_files": files}
    if not os.access(existing, os.W_OK):
        return Check(name, "warn", f"torch is installed without .pyc files and {why}, and {where} is not "
                     "writable: every replica compiles the modules it imports",
                     "point COLDSTART_BYTECODE_CACHE (or TRITON_CACHE_DIR) at a writable directory", data)
    kept = (f"torch is installed without .pyc files and {why}: replicas keep the compiled modules in {where} "
            f"({files} files now; the first replica on a node writes them)")
    if bytecode.needed("ray"):  # and Ray's worker compiles its own before a replica's code runs
        return Check(name, "warn", f"{kept}; but Ray is installed without them too, and each replica's worker "
                     "compiles Ray's modules before the replica's code can keep anything (a minimal replica "
                     "started in 9.2 s instead of 4.3 s on an H200 host, docs/measurements.md)",
                     f"give the whole worker the cache: PYTHONPYCACHEPREFIX={where} and PYTHONDONTWRITEBYTECODE=\"\" "
                     "in serve_config.yaml's runtime_env env_vars (commented there), or install the packages "
                     "with their .pyc files", {**data, "ray_compiled": False})
    return Check(name, "ok", kept, "", data)
