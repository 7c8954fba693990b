"""A per-node cache of compiled Python modules, for interpreters that keep none.

Where the installed packages hold no ``.pyc`` files and the interpreter may not write
them (``PYTHONDONTWRITEBYTECODE=1``, common in container images, or a read-only
install), every process compiles each module it imports from its source (``import torch``
alone compiles some 770 modules). ``enable`` then points the interpreter's bytecode cache
(``sys.pycache_prefix``) at a directory kept per node, beside Triton's kernel cache
(``deployments.node_cache``), and lets it write there: the first replica on a node
compiles and writes, every later one reads. Nothing changes where the interpreter
finds or may write the ``.pyc`` files itself, or where PYTHONPYCACHEPREFIX is set.

Python checks each cached file against its source's size and mtime, so an upgraded
package is compiled again; files are written atomically, so replicas that start together
share the directory safely. COLDSTART_BYTECODE_CACHE: ``0`` turns this off, a path puts
the cache there. Imports nothing heavy: it runs before torch is imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Mapping

from deployments import envs

log = logging.getLogger(__name__)

SUBDIR = "coldstart-bytecode"


def needed(probe: str = "torch") -> bool:
    """Whether importing ``probe`` (a top-level package, not imported here) would compile its
    source for want of a ``.pyc`` the interpreter can read or write."""
    if sys.pycache_prefix is not None:  # set by the user (or already by ``enable``)
        return False
    try:
        spec = importlib.util.find_spec(probe)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    pyc = importlib.util.cache_from_source(spec.origin)
    if os.path.exists(pyc):
        return False
    cache = os.path.dirname(pyc)  # <package>/__pycache__: written where it or its parent may be
    writable = os.access(cache, os.W_OK) if os.path.isdir(cache) else os.access(os.path.dirname(cache), os.W_OK)
    return sys.dont_write_bytecode or not writable


def cache_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Where a replica keeps compiled modules when it needs to: COLDSTART_BYTECODE_CACHE, else
    ``coldstart-bytecode`` beside Triton's kernel cache; None where COLDSTART_BYTECODE_CACHE=0."""
    choice = envs.read("COLDSTART_BYTECODE_CACHE", env)
    if choice == "0":
        return None
    if choice:
        return choice
    from deployments.node_cache import triton_cache_dir
    return os.path.join(triton_cache_dir(env), SUBDIR)


def enable(env: Mapping[str, str] | None = None, probe: str = "torch") -> str | None:
    """Keep this process's compiled modules in the node's cache from now on, where ``needed``;
    the cache's directory, or None (not needed, turned off, or no writable place)."""
    if not needed(probe):
        return None
    where = cache_dir(env)
    if where is None:
        return None
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as e:
        log.info("no bytecode cache (%s): every start compiles the modules it imports", e)
        return None
    if not os.access(where, os.W_OK):
        log.info("no bytecode cache (%s is not writable): every start compiles the modules it imports", where)
        return None
    sys.pycache_prefix = where
    sys.dont_write_bytecode = False  # (written only under the prefix, never beside the sources)
    log.info("compiled modules kept in %s: the interpreter keeps none of its own", where)
    return where
