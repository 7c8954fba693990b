"""deployments.bytecode: a per-node cache of compiled modules where the interpreter keeps none."""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.startup import bytecode

ROOT = Path(__file__).resolve().parents[1]


def _package(tmp_path: Path, name: str = "cs_probe_pkg") -> Path:
    pkg = tmp_path / "src" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import mod\nVALUE = mod.VALUE + 1\n")
    (pkg / "mod.py").write_text("VALUE = 41\n")
    return pkg


def test_needed_only_where_the_interpreter_would_compile_every_time(tmp_path, monkeypatch):
    pkg = _package(tmp_path)
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode.needed("cs_probe_pkg")  # no .pyc, and none may be written
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert not bytecode.needed("cs_probe_pkg")  # the interpreter writes its own
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    init = str(pkg / "__init__.py")
    py_compile.compile(init, cfile=importlib.util.cache_from_source(init))
    assert not bytecode.needed("cs_probe_pkg")  # installed with its .pyc files
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))
    assert not bytecode.needed("cs_probe_pkg")  # the user's own prefix stays
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert not bytecode.needed("no_such_package_here")


def test_enable_is_off_without_a_place_to_keep_it(monkeypatch, tmp_path):
    pkg = _package(tmp_path)
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode.enable({"COLDSTART_BYTECODE_CACHE": "0"}, probe="cs_probe_pkg") is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert bytecode.enable({"COLDSTART_BYTECODE_CACHE": str(blocker / "cache")}, probe="cs_probe_pkg") is None
    assert sys.pycache_prefix is None and sys.dont_write_bytecode


_SCRIPT = """
import importlib._bootstrap_external as external, json, sys
compiled = []
original = external.SourceLoader.source_to_code
def counted(self, data, path, *a, **k):
    compiled.append(str(path))
    return original(self, data, path, *a, **k)
external.SourceLoader.source_to_code = counted
from deployments.startup import bytecode
where = bytecode.enable(probe="cs_probe_pkg")
compiled.clear()
import cs_probe_pkg
print(json.dumps({"where": where, "value": cs_probe_pkg.VALUE,
                  "compiled": sorted(p.rsplit("/", 1)[-1] for p in compiled)}))
"""


def _start(pkg: Path, **env: str) -> dict:
    e = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{pkg.parent}", **env}
    e.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_first_process_compiles_and_keeps_every_later_one_reads(tmp_path):
    pkg = _package(tmp_path)
    cache = tmp_path / "node-cache"
    first = _start(pkg, COLDSTART_BYTECODE_CACHE=str(cache))
    assert first == {"where": str(cache), "value": 42, "compiled": ["__init__.py", "mod.py"]}
    kept = sorted(p.name for p in cache.rglob("*.pyc"))
    assert len(kept) == 2 and all(p.startswith(("__init__.", "mod.")) for p in kept)
    assert not (pkg / "__pycache__").exists()  # nothing written beside the sources
    assert _start(pkg, COLDSTART_BYTECODE_CACHE=str(cache))["compiled"] == []  # read, not compiled
    (pkg / "mod.py").write_text("VALUE = 1\n")  # a changed source is compiled again, never stale
    again = _start(pkg, COLDSTART_BYTECODE_CACHE=str(cache))
    assert again["value"] == 2 and again["compiled"] == ["mod.py"]
    off = _start(pkg, COLDSTART_BYTECODE_CACHE="0")
    assert off["where"] is None and off["compiled"] == ["__init__.py", "mod.py"]


def test_a_default_cache_sits_beside_tritons(tmp_path):
    pkg = _package(tmp_path)
    res = _start(pkg, TRITON_CACHE_DIR=str(tmp_path / "triton"), COLDSTART_BYTECODE_CACHE="")
    assert res["where"] == str(tmp_path / "triton" / bytecode.SUBDIR)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_install_is_needed_even_when_writes_are_allowed(tmp_path, monkeypatch):
    pkg = _package(tmp_path)
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    pkg.chmod(0o555)
    try:
        assert bytecode.needed("cs_probe_pkg")
    finally:
        pkg.chmod(0o755)
