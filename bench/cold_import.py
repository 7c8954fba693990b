"""Cold page cache: the read-ahead of the weights against `import torch` on the same disk.

    python bench/cold_import.py PACKED --out OUT/cold-import.json      (as root: drops the page cache)

A replica with a cold page cache reads torch's libraries (import) and the weights
from one disk. `weights.readahead.prefetch` starts the weights' read-ahead before
the import, so both share the disk. Each case starts from a dropped cache:

  import-alone          `import torch` in a fresh process, nothing else reading
  prefetch-alone        the read-ahead helper alone: seconds until the file is resident
  import-with-prefetch  the helper started, then `import torch`; then the seconds until
                        the weights are resident (what a replica's load would wait for)
  import-with-gentle    a gentler helper (one 1 MiB read at a time) beside `import torch`,
                        the hints after it; the same two figures
  import-with-gentle-8MiB  the same, 8 MiB per read, and how much was read by the import's end
  replica[...]          a replica's imports phase with Triton's head start (as it is,
                        without it, with Triton's key hashed), cold, then warm
  pread-16              16 threads reading the file (the loader's cold pattern), for scale

Prints and writes one JSON; the figures say whether the overlap pays on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from weights.readahead import _HINTS, PIECE, resident_fraction  # noqa: E402

# One read at a time, front to back: the page cache fills at a pace that leaves the disk's
# queue to whoever else reads (an import's page faults), unlike the replica's hints, which
# queue the whole file at once
_GENTLE = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
piece, limit = int(sys.argv[2]), int(sys.argv[3])
size = min(os.fstat(fd).st_size, limit)
buf = bytearray(piece)
off = 0
while off < size:
    n = os.preadv(fd, [memoryview(buf)[:min(piece, size - off)]], off)
    if n <= 0:
        break
    off += n
"""
GENTLE_PIECE = 1 << 20



def drop() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def import_torch() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t


# A replica's imports phase (deployments.server.LLMServer), then the wait for Triton's
# head start that the first kernel self-test does; prints both times
_REPLICA = r"""
import time
from deployments.startup import triton_setup as head_start
from deployments.server import import_engine  # (a replica's module: imported before it starts)
t = time.perf_counter()
import_engine("cuda")
a = time.perf_counter() - t
head_start.wait()
print(a, time.perf_counter() - t)
"""


def replica_imports(env: dict | None = None) -> tuple[float, float]:
    """(imports, imports + the head start's wait) of a replica, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _REPLICA], check=True, capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    a, b = out.stdout.split()[-2:]
    return float(a), float(b)


def helper(path: Path, gentle: bool = False, piece: int = GENTLE_PIECE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _GENTLE if gentle else _HINTS, str(path),
                             str(piece if gentle else PIECE), str(path.stat().st_size)])


def until_resident(path: Path, t0: float, limit_s: float = 120.0) -> float:
    while time.perf_counter() - t0 < limit_s:
        f = resident_fraction(path, samples=256)
        if f is not None and f >= 0.99:
            break
        time.sleep(0.05)
    return time.perf_counter() - t0


def pread(path: Path, threads: int = 16, chunk: int = 8 << 20) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    offsets = iter(range(0, path.stat().st_size, chunk))
    lock = threading.Lock()

    def work() -> None:
        buf = bytearray(chunk)
        while True:
            with lock:
                off = next(offsets, None)
            if off is None:
                return
            os.preadv(fd, [buf], off)
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packed", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    f = a.packed / "model.cst" if a.packed.is_dir() else a.packed
    gb = f.stat().st_size / 1e9
    res: dict = {"file_GB": gb}
    drop()
    res["import_alone_s"] = import_torch()
    drop()
    t0 = time.perf_counter()
    helper(f).wait()
    res["prefetch_alone_s"] = until_resident(f, t0)
    drop()
    t0 = time.perf_counter()
    h = helper(f)
    res["import_with_prefetch_s"] = import_torch()
    h.wait()
    res["import_with_prefetch_resident_s"] = until_resident(f, t0)
    drop()
    t0 = time.perf_counter()
    g = helper(f, gentle=True)  # one read at a time beside the import, then the hints
    res["import_with_gentle_s"] = import_torch()
    helper(f).wait()
    res["import_with_gentle_resident_s"] = until_resident(f, t0)
    g.kill()
    drop()
    t0 = time.perf_counter()
    g = helper(f, gentle=True, piece=8 << 20)  # the same with 8 MiB reads
    res["import_with_gentle_8MiB_s"] = import_torch()
    res["gentle_8MiB_read_during_import_GB"] = gb * (resident_fraction(f, samples=256) or 0.0)
    helper(f).wait()
    res["import_with_gentle_8MiB_resident_s"] = until_resident(f, t0)
    g.kill()
    # the replica's own imports phase: as it is, without Triton's head start, and with
    # Triton's key computed (its 400 MB library hashed) rather than kept
    for name, env in (("replica", None), ("replica_no_head_start", {"COLDSTART_TRITON": "0"}),
                      ("replica_triton_key_hashed", {"COLDSTART_KERNEL_VERDICTS": "0"})):
        replica_imports(env)  # the kept files and caches exist before the cold run
        drop()
        res[f"{name}_imports_s"], res[f"{name}_imports_and_head_start_s"] = replica_imports(env)
        res[f"{name}_warm_imports_s"], res[f"{name}_warm_imports_and_head_start_s"] = replica_imports(env)
    drop()
    res["pread16_s"] = pread(f)
    res["prefetch_alone_GBps"] = gb / res["prefetch_alone_s"]
    res["pread16_GBps"] = gb / res["pread16_s"]
    # the sequential alternative: import, then read the weights as fast as the better pattern
    res["sequential_estimate_s"] = res["import_alone_s"] + gb / max(res["prefetch_alone_GBps"], res["pread16_GBps"])
    res["command"] = "python bench/cold_import.py " + " ".join(sys.argv[1:])
    print(json.dumps(res, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
