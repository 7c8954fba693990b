"""Compiled kernels shipped with a packed model (deployments.kernels.bundle, `coldstart kernels`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import gpu
from deployments.kernels import bundle

H200 = "NVIDIA H200"


@pytest.fixture
def node(monkeypatch):
    """A node whose GPU model the driver names (this machine may have none)."""
    monkeypatch.setattr(bundle, "_gpu_model", lambda: H200)
    return bundle.node_facts()


def _cache(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_a_shipped_bundle_is_installed_once_and_checked(node, tiny_packed, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_packed, model)
    assert "no compiled kernels shipped" in bundle.install(model, tmp_path / "cache")
    made = _cache(tmp_path / "made", {"abc123/k.cubin": b"\x7fELF", "abc123/k.json": b"{}",
                                      "coldstart-selftest-1.json": b'{"passed": true}',
                                      "coldstart-bytecode/x.pyc": b"not shipped"})
    dest = bundle.write(model, made)
    assert dest.parent == model / "kernels" and dest.name == bundle.key(node)
    manifest = json.loads((dest / bundle.MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["abc123/k.cubin", "abc123/k.json", "coldstart-selftest-1.json"]
    assert manifest["facts"]["gpu"] == H200
    line = bundle.install(model, tmp_path / "cache")
    assert "3 files installed" in line and (tmp_path / "cache" / "abc123" / "k.cubin").read_bytes() == b"\x7fELF"
    assert "0 files installed" in bundle.install(model, tmp_path / "cache")
    # another engine setting's kernels are merged into the same bundle
    more = _cache(tmp_path / "more", {"def456/k2.cubin": b"\x7fELF2"})
    bundle.write(model, more)
    line = bundle.install(model, tmp_path / "cache")
    assert "1 files installed" in line and line.endswith("3 there already")


def test_a_changed_file_is_never_installed(node, tiny_packed, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_packed, model)
    dest = bundle.write(model, _cache(tmp_path / "made", {"a/k.cubin": b"good"}))
    (dest / "a" / "k.cubin").write_bytes(b"evil")
    line = bundle.install(model, tmp_path / "cache")
    assert "not what its manifest says" in line and not (tmp_path / "cache" / "a" / "k.cubin").exists()


def test_a_bundle_for_another_node_says_so(node, tiny_packed, tmp_path, monkeypatch):
    model = tmp_path / "m"
    shutil.copytree(tiny_packed, model)
    bundle.write(model, _cache(tmp_path / "made", {"a/k.cubin": b"x"}), facts={**node, "gpu": "NVIDIA A100-SXM4-80GB"})
    line = bundle.install(model, tmp_path / "cache")
    assert "compiled for NVIDIA A100-SXM4-80GB" in line and f"not for this node ({H200}" in line
    assert not (tmp_path / "cache").exists()


def test_no_bundle_without_a_single_gpu_model(tiny_packed, tmp_path, monkeypatch):
    monkeypatch.setattr(bundle, "_gpu_model", lambda: None)
    with pytest.raises(ValueError, match="no single GPU model on this node"):
        bundle.write(tmp_path, tmp_path)


def test_the_gpu_model_is_read_from_the_drivers_files(tmp_path):
    for i, name in enumerate(["NVIDIA H200", "NVIDIA H200"]):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
        (tmp_path / f"0000:0{i}:00.0" / "information").write_text(f"Model: \t\t {name}\nIRQ:   1\n")
    assert bundle._gpu_model(tmp_path) == "NVIDIA H200"
    (tmp_path / "0000:09:00.0").mkdir()
    (tmp_path / "0000:09:00.0" / "information").write_text("Model: \t\t NVIDIA A100\n")
    assert bundle._gpu_model(tmp_path) is None  # mixed models: no one bundle fits


@gpu
def test_gpu_a_new_node_with_the_shipped_kernels_compiles_nothing(tiny_packed, tmp_path):
    """`coldstart kernels` on this GPU, then a replica's start with an empty Triton cache: every
    file the start finds in the cache afterwards came from the bundle (nothing was compiled)."""
    import os
    import subprocess
    import sys

    model = tmp_path / "m"
    shutil.copytree(tiny_packed, model)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "deployments.tools.cli", "kernels", str(model), "--max-seq-len", "128"],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shipped = set(json.loads(next((model / "kernels").glob("*/manifest.json")).read_text())["files"])
    assert any(f.endswith(".cubin") for f in shipped), sorted(shipped)[:10]
    cache = tmp_path / "fresh-cache"
    code = ("import logging; logging.basicConfig(level=logging.INFO); "
            "from deployments.server.replica import LLMServer; "
            f"s = LLMServer({str(model)!r}, device='cuda', engine={{'max_slots': 2, 'max_seq_len': 128}}); "
            "s.reconfigure({'warmup': {'requests': 1, 'batch_sizes': [1, 2]}}); s.shutdown()")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stderr[-3000:]
    found = {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()
             and not str(p.relative_to(cache)).startswith("coldstart-bytecode")}
    assert found <= shipped, sorted(found - shipped)[:10]
    assert "files installed" in r.stderr
