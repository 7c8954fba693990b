"""Compiled decode kernels that travel with a packed model, so a new node compiles nothing.

Triton compiles the decode kernels at a node's first replica and keeps them in its cache
directory; coldstart keeps its kernel verdicts beside them (``deployments.node_cache``). A
node that never ran the model has neither, and its first replica pays every compile.
``coldstart kernels DIR`` (on a GPU of the kind the replicas will run on) starts the model once
with an empty cache and keeps what that start wrote in ``DIR/kernels/<key>/``, with a manifest
of each file's sha256. The key names what the compiled files depend on (``node_facts``): the
GPU model, torch, Triton and the kernels' own code. A replica's first step installs the bundle
whose key is its node's (``install``: every file checked against its digest, copied into the
node's Triton cache where it is missing) before Triton's first use; where none matches, or a
file does not check, the replica compiles as before, and one log line says why.

Imports no torch: it runs before the replica's imports.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from deployments.node_cache import triton_cache_dir
from weights.format import file_sha256

log = logging.getLogger(__name__)

SUBDIR = "kernels"
MANIFEST = "manifest.json"
# the files whose code the compiled kernels and verdicts follow
_CODE = ("triton_jit.py", "ops.py", "policy.py", "quant_jit.py", "quant.py")
_PROC_GPUS = Path("/proc/driver/nvidia/gpus")


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """The kernels' code and their policy's, hashed (a kept verdict's and a bundle's key have it)."""
    h = hashlib.sha256()
    for name in _CODE:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()


def _gpu_model(proc: Path = _PROC_GPUS) -> str | None:
    """This node's GPU model as the driver names it, without CUDA (the driver's /proc files, else
    nvidia-smi); None where there is none, or where the node's GPUs are of several models."""
    names = set()
    for info in sorted(proc.glob("*/information")) if proc.is_dir() else []:
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                names.add(line.split(":", 1)[1].strip())
    if not names:
        from deployments.gpu_facts import probe_driver
        names = {g.name for g in probe_driver()[1]}
    return names.pop() if len(names) == 1 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def node_facts() -> dict[str, str | None]:
    """What compiled kernels depend on, read without importing torch or touching CUDA."""
    return {"gpu": _gpu_model(), "torch": _version("torch"), "triton": _version("triton"), "kernels": code_hash()}


def key(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _kept_files(cache: Path) -> list[Path]:
    """What a start leaves in a Triton cache that a new node can use: Triton's compiled kernels and
    its launcher's helper module, and coldstart's kernel verdicts (not the bytecode cache: the image
    ships compiled modules)."""
    out = []
    for p in sorted(cache.rglob("*")):
        rel = p.relative_to(cache)
        if p.is_file() and rel.parts[0] != "coldstart-bytecode" and not p.name.endswith(".tmp"):
            out.append(p)
    return out


def write(model_dir: str | os.PathLike, cache: str | os.PathLike, facts: dict | None = None) -> Path:
    """Keep the files of Triton cache ``cache`` in ``model_dir``'s bundle for ``facts`` (this node's,
    by default), merged with what the bundle holds already (another engine setting's kernels);
    atomic: the bundle is replaced whole. Returns the bundle's directory."""
    facts = facts or node_facts()
    if not facts.get("gpu"):
        raise ValueError("no single GPU model on this node (driver /proc files and nvidia-smi): run "
                         "`coldstart kernels` on a node of the GPU kind the replicas will run on")
    root = Path(model_dir) / SUBDIR
    dest = root / key(facts)
    root.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=root))
    try:
        if dest.is_dir():
            shutil.copytree(dest, tmp, dirs_exist_ok=True)
        cache = Path(cache)
        for f in _kept_files(cache):
            target = tmp / f.relative_to(cache)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
        (tmp / MANIFEST).unlink(missing_ok=True)
        files = {str(p.relative_to(tmp)): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"facts": facts, "made_at": time.time(), "files": files}, indent=1))
        old = root / f".{dest.name}.old-{os.getpid()}"
        if dest.exists():
            os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def install(model_dir: str | os.PathLike, cache: str | os.PathLike | None = None) -> str:
    """Copy ``model_dir``'s bundle for this node into the node's Triton cache (``cache``, by default
    Triton's own) where its files are missing, each checked against the manifest first. Returns one
    line for the log: what was installed, or why nothing was (the replica then compiles)."""
    root = Path(model_dir) / SUBDIR
    if not root.is_dir():
        return f"no compiled kernels shipped with {model_dir} ({SUBDIR}/ missing): this node compiles its own"
    facts = node_facts()
    bundle = root / key(facts)
    if not (bundle / MANIFEST).is_file():
        made = sorted(_facts_of(p) for p in root.iterdir() if (p / MANIFEST).is_file())
        return (f"the kernels shipped with {model_dir} were compiled for {'; '.join(made) or 'nothing'}, "
                f"not for this node ({_describe(facts)}): it compiles its own")
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{bundle / MANIFEST}: unreadable ({e}); this node compiles its own kernels"
    cache = Path(cache) if cache is not None else triton_cache_dir()
    copied = 0
    for rel, digest in files.items():
        src, dst = bundle / rel, cache / rel
        if ".." in Path(rel).parts or not src.is_file() or file_sha256(src) != digest:
            return f"{src}: missing or not what its manifest says; this node compiles the kernels it lacks"
        if dst.exists():
            continue
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            part = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            shutil.copy2(src, part)
            os.replace(part, dst)
        except OSError as e:
            return f"{cache}: cannot be written ({e}); this node compiles its own kernels"
        copied += 1
    return f"compiled kernels for {_describe(facts)} from {bundle}: {copied} files installed in {cache}, " \
           f"{len(files) - copied} there already"


def _facts_of(bundle: Path) -> str:
    try:
        return _describe(json.loads((bundle / MANIFEST).read_text())["facts"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{bundle.name} (unreadable manifest)"


def _describe(facts: dict) -> str:
    return (f"{facts.get('gpu')}, torch {facts.get('torch')}, Triton {facts.get('triton')}, "
            f"kernels {str(facts.get('kernels'))[:12]}")
