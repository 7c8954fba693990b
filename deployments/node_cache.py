"""What a node keeps for its next replicas: remote packed models (``model_cache``, the directory
``weights.cache`` manages) and files beside Triton's compiled kernels.

Triton keeps the kernels it compiles in its cache directory (TRITON_CACHE_DIR, else
TRITON_HOME or the home directory, ``.triton/cache``), which lives as long as the node (or
the volume mounted there). coldstart keeps what it works out once per node beside them:
the kernels' self-test passes and GEMV choice (``deployments.kernels.policy``) and compiled
Python modules where the interpreter keeps none (``deployments.startup.bytecode``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from deployments import envs

if TYPE_CHECKING:
    from weights.cache import NodeCache


def triton_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where Triton keeps compiled kernels: TRITON_CACHE_DIR, else TRITON_HOME (or ~)/.triton/cache."""
    if envs.read("TRITON_CACHE_DIR", env):
        return Path(envs.read("TRITON_CACHE_DIR", env))
    return Path(envs.read("TRITON_HOME", env) or os.path.expanduser("~")) / ".triton" / "cache"


def model_cache(env: Mapping[str, str] | None = None) -> "NodeCache":
    """The node's cache of remote packed models (COLDSTART_CACHE_DIR, COLDSTART_CACHE_MAX_GB)."""
    from weights.cache import NodeCache, default_root
    root = envs.read("COLDSTART_CACHE_DIR", env)
    return NodeCache(Path(root) if root else default_root(), int(envs.read("COLDSTART_CACHE_MAX_GB", env) * 1e9))


def write_kept(path: str | os.PathLike, text: str) -> OSError | None:
    """Write a file a node keeps atomically: a reader sees the old file, no file, or the whole
    new one. Returns the error where the directory cannot be written (the caller then works it
    out again at its next start)."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        os.makedirs(head or ".", exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return e
    return None
