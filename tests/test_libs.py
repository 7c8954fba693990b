"""deployments.startup.libs: the cuBLAS libraries found without torch and read into the page
cache, and the worker setup hook's thread that does it where COLDSTART_PREFETCH_LIBS is on."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

from deployments import envs
from deployments.startup import libs

ROOT = Path(__file__).resolve().parents[1]


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def _fake_site(root: Path) -> list[Path]:
    """A site-packages with CUDA 12's and CUDA 13's wheel layouts and a torch carrying its own
    copy, symlinks and other libraries among them; the cuBLAS files, real paths."""
    want = [_file(root / "nvidia/cublas/lib/libcublas.so.12", 3000),
            _file(root / "nvidia/cublas/lib/libcublasLt.so.12", 5000),
            _file(root / "nvidia/cu13/lib/libcublasLt.so.13", 7000),
            _file(root / "torch/lib/libcublasLt-0a1b2c3d.so.12", 1100)]  # as auditwheel names a bundled copy
    (root / "nvidia/cublas/lib/libcublasLt.so").symlink_to("libcublasLt.so.12")
    (root / "nvidia/cu13/lib/libcublasLt.so").symlink_to("libcublasLt.so.13")
    (root / "torch/lib/libcublas.so.12").symlink_to(root / "nvidia/cublas/lib/libcublas.so.12")
    (root / "nvidia/cu13/lib/libcublas.so.13").symlink_to("no-such-file")  # dangling: nothing to read
    (root / "nvidia/cu13/lib/libcublas.so.13.d").mkdir()  # a folder, not a library
    for other in ("nvidia/cublas/lib/libnvblas.so.12", "nvidia/cublas/lib/libcublas_static.a",
                  "nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12",
                  "nvidia/cublas/include/cublas_v2.h", "nvidia/cublas/libcublas.so.12",  # not in a lib folder
                  "torch/lib/libtorch_cuda.so", "torch/libcublasLt.so.12", "elsewhere/lib/libcublas.so.12"):
        _file(root / other, 100)
    (root / "nvidia/nccl/lib").mkdir(parents=True)
    return [p.resolve() for p in want]


def test_find_on_this_machine_names_only_cublas_files():
    found = libs.find()
    assert len(found) == len(set(found))
    for p in found:
        assert os.path.isfile(p) and not os.path.islink(p) and os.path.realpath(p) == p, p
        assert any(fnmatch.fnmatchcase(os.path.basename(p), pat) for pat in libs.PATTERNS), p


def test_find_in_wheel_layouts_once_per_real_file(tmp_path):
    want = _fake_site(tmp_path / "site")
    found = libs.find([str(tmp_path / "site"), str(tmp_path / "no-such-site")])
    assert sorted(found) == sorted(map(str, want))
    assert libs.find([str(tmp_path / "no-such-site")]) == []


def test_prefetch_reads_every_byte_and_skips_what_it_cannot_read(tmp_path):
    chunk = 4096
    sizes = (0, 1, chunk - 1, chunk, 3 * chunk + 5)
    paths = [str(_file(tmp_path / f"f{i}", n)) for i, n in enumerate(sizes)]
    listed = paths[:2] + [str(tmp_path / "missing"), str(tmp_path)] + paths[2:]  # a missing file, a folder
    r = libs.prefetch(listed, chunk=chunk)
    assert r["files"] == len(sizes) and r["bytes"] == sum(sizes) and r["s"] >= 0
    big = _file(tmp_path / "big", libs.CHUNK + 12345)  # more than one default chunk
    r = libs.prefetch([str(big)])
    assert (r["files"], r["bytes"]) == (1, libs.CHUNK + 12345)
    assert libs.prefetch([]) == {"files": 0, "bytes": 0, "s": 0.0}


def test_the_variable_is_a_flag_off_by_default():
    assert envs.read("COLDSTART_PREFETCH_LIBS", {}) is False
    assert envs.read("COLDSTART_PREFETCH_LIBS", {"COLDSTART_PREFETCH_LIBS": "1"}) is True


def _run(code: str, site: Path, **env: str) -> dict:
    # the fake site joins the `nvidia` namespace package, so the hook's own find() reads its files
    path = os.pathsep.join(filter(None, (str(ROOT), str(site), os.environ.get("PYTHONPATH"))))
    base = {k: v for k, v in os.environ.items() if k != "COLDSTART_PREFETCH_LIBS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**base, "PYTHONPATH": path, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


_HOOK = """
import json, os, threading, time
from deployments.startup import early, libs
before = time.time()
early.hook()
first = early._libs_thread
early.hook()  # once per process: a second call starts no second thread
if first is not None:
    first.join(240)
assert early.wait(240)
found = libs.find()
print(json.dumps({"before": before, "name": first.name if first else None, "alive": bool(first and first.is_alive()),
                  "same": early._libs_thread is first, "torch": "torch" in __import__("sys").modules,
                  "running": [t.name for t in threading.enumerate() if t.name.startswith("coldstart-prefetch")],
                  "times": early.times(), "found": found, "size": sum(os.path.getsize(p) for p in found)}))
"""


def test_the_hook_reads_the_libraries_on_its_own_thread_even_without_early_imports(tmp_path):
    want = _fake_site(tmp_path / "site")
    out = _run(_HOOK, tmp_path / "site", COLDSTART_PREFETCH_LIBS="1", COLDSTART_EARLY_IMPORT="0")
    assert out["name"] == "coldstart-prefetch-libs" and out["same"] and not out["alive"]
    assert not out["torch"]  # found and read without importing torch
    # the fake nvidia folder joins the namespace package; torch is the installed one, not the fake
    assert {str(p) for p in want if "/nvidia/" in str(p)} <= set(out["found"])
    t = out["times"]
    assert "hook_at" not in t  # no imports asked for: the import thread did not start
    assert t["libs_prefetch_files"] == len(out["found"]) and t["libs_prefetch_bytes"] == out["size"] > 0
    assert out["before"] <= t["libs_prefetch_done_at"] and t["libs_prefetch_s"] >= 0


def test_the_hook_reads_the_libraries_beside_the_imports(tmp_path):
    _fake_site(tmp_path / "site")
    out = _run(_HOOK, tmp_path / "site", COLDSTART_PREFETCH_LIBS="1", COLDSTART_EARLY_IMPORT="json")
    t = out["times"]
    assert out["name"] == "coldstart-prefetch-libs" and out["same"]
    assert t["hook_at"] <= t["json_at"] <= t["done_at"]  # the imports go on as without it
    assert t["libs_prefetch_bytes"] == out["size"] > 0


def test_the_hook_reads_nothing_when_turned_off(tmp_path):
    _fake_site(tmp_path / "site")
    for env in ({}, {"COLDSTART_PREFETCH_LIBS": "0"}):
        out = _run(_HOOK, tmp_path / "site", COLDSTART_EARLY_IMPORT="json", **env)
        assert out["name"] is None and out["running"] == []
        assert not any(k.startswith("libs_") for k in out["times"]) and "done_at" in out["times"]
