"""How much of a replica's imports is Python compiling source, for want of a usable .pyc.

In a fresh process, imports what a replica imports (torch; then the engine's modules and
Triton, as ``deployments.server.import_engine`` does) and counts, per top-level package,
the modules whose code came from compiling their source instead of a cached .pyc, and the
seconds it took. Run it twice: the second run shows whether the first one's .pyc files
were written and found (a read-only site-packages, or PYTHONDONTWRITEBYTECODE, makes every
process compile again; PYTHONPYCACHEPREFIX moves the cache somewhere writable).

    PYTHONPATH=$PWD python bench/import_compile.py [--out import-compile.json]
"""

from __future__ import annotations

import argparse
import collections
import importlib._bootstrap_external as external
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package(path: str) -> str:
    p = Path(path)
    parts = p.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1:]
            return rest[0] if rest else str(p)
    try:
        return "project:" + p.relative_to(ROOT).parts[0]
    except ValueError:
        return "stdlib" if "python3" in path else str(p.parent)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the counts here as JSON")
    ap.add_argument("--device", default="cuda", help="as a replica's device argument (import_engine)")
    a = ap.parse_args(argv)

    counts: collections.Counter = collections.Counter()
    seconds: collections.Counter = collections.Counter()
    original = external.SourceLoader.source_to_code

    def source_to_code(self, data, path, *args, **kwargs):  # noqa: ANN001 - importlib's own signature
        t = time.perf_counter()
        try:
            return original(self, data, path, *args, **kwargs)
        finally:
            key = _package(str(path))
            counts[key] += 1
            seconds[key] += time.perf_counter() - t

    external.SourceLoader.source_to_code = source_to_code
    steps = {}
    t = time.perf_counter()
    import torch  # noqa: F401
    steps["import_torch_s"] = time.perf_counter() - t
    compiled_by_torch = sum(counts.values())
    sys.path.insert(0, str(ROOT))
    t = time.perf_counter()
    from deployments.server import import_engine
    import_engine(a.device)
    from deployments.startup import triton_setup as head_start
    head_start.wait()
    steps["import_engine_s"] = time.perf_counter() - t
    res = {
        "python": sys.version.split()[0],
        "dont_write_bytecode": sys.flags.dont_write_bytecode,
        "pycache_prefix": sys.pycache_prefix,
        "env": {k: os.environ.get(k) for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")},
        "torch_dir_writable": os.access(os.path.dirname(torch.__file__), os.W_OK),
        **{k: round(v, 3) for k, v in steps.items()},
        "compiled_modules_by_import_torch": compiled_by_torch,
        "compiled_modules": sum(counts.values()),
        "compile_s": round(sum(seconds.values()), 3),
        "by_package": {k: {"modules": n, "compile_s": round(seconds[k], 3)} for k, n in counts.most_common()},
    }
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
