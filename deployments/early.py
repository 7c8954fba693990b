"""A replica's imports from its process's first moments, beside Ray's own start of the worker.

Between the controller asking for a replica and the replica's constructor, Ray starts a
worker process, imports itself, connects to the node, receives the actor, imports Serve's
replica and unpickles the deployment's class: some 4 s on an H200 host, during which the
process waits on its node as much as it computes. Only then would the constructor import
torch (1.4-1.8 s there). Ray runs a worker's *setup hook* right after the worker connects,
before it takes the actor: serve_config.yaml names ``deployments.early.hook`` there, and the
hook starts a thread that imports torch and the engine's modules while Ray's main thread goes
on. The constructor's own imports then find them done, or wait for the rest.

Nothing here may touch the GPU: Ray sets CUDA_VISIBLE_DEVICES when the actor arrives, after
the hook, and CUDA fixes the devices a process sees at its first call (``cuInit``). So the
thread imports modules only, none of which calls CUDA at import (``deployments.kernels``
decides on Triton from the build and the driver's device file, not from
``torch.cuda.is_available()``); the context, the kernels' self-tests and Triton's driver stay
in the constructor. The bytecode cache (``deployments.bytecode``) is turned on first, as the
constructor would: where the packages carry no ``.pyc`` files, Ray's own imports after the hook
(Serve's replica module among them) then read compiled modules too.

Ray takes the hook from the reserved env var ``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR`` (its
``runtime_env.worker_process_setup_hook`` field sets that var for a job's workers only, not for
one application's replicas); a process without it, or with env COLDSTART_EARLY_IMPORT=0, imports
in the constructor as before (a comma-separated list of modules imports those instead of
``MODULES``; bench/serve.py's minimal-early imports torch alone). A hook that fails never fails
the worker: the constructor's imports raise the error where the replica reports it.

The hook also turns Python's cyclic garbage collector off for the start (``pause_gc``): the
start makes a few hundred thousand long-lived objects (torch, Ray, the engine: a 7B replica on
an H200 froze 452,511), and each full collection the imports trigger walks all of them again
(``import torch`` alone took 1.34-1.39 s with it on against 1.15-1.24 s off, on a development
VM), as does the ``gc.collect()`` Ray runs after the first ``reconfigure``. Once the replica is
warm, ``resume_gc(freeze=True)`` moves every object into the collector's permanent generation
(``gc.freeze()``: never walked again, so Ray's collection finds only what the warm-up made) and
turns it back on. The start's own cyclic garbage is not collected then (some 9,000 objects after
the imports, once per process). A replica that fails to start turns it back on without freezing.
Env COLDSTART_PAUSE_GC=0 leaves the collector on.
"""

from __future__ import annotations

import gc
import os
import threading
import time

ENV_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
"""Where Ray's worker (ray/_private/workers/default_worker.py) looks for its setup hook: a
``module.function`` path it imports and calls once connected."""
HOOK = "deployments.early.hook"

# the engine's modules, in the order the constructor imports them (server.import_engine): none
# of them calls CUDA at import
MODULES = ("torch", "deployments.engine", "deployments.model", "deployments.tokenizer", "weights.loader")

_times: dict[str, float] = {}
_thread: threading.Thread | None = None
_error: list[BaseException] = []
_gc: dict[str, float] = {}  # paused_at, resumed_at (Unix times), frozen (objects)


def hook() -> None:
    """Ray's worker setup hook: pause the garbage collector, turn on the bytecode cache and
    start the import thread (once per process); returns at once, so Ray's start of the worker
    goes on."""
    global _thread
    pause_gc()
    if _thread is not None or not modules():
        return
    _times["hook_at"] = time.time()
    try:
        from deployments import bytecode
        bytecode.enable()  # what the replica's constructor turns on before its imports
    except Exception:  # noqa: BLE001 - no cache: the imports compile, as without the hook
        pass
    _thread = threading.Thread(target=_imports, name="coldstart-early-import", daemon=True)
    _thread.start()


def modules(env: os._Environ | dict = os.environ) -> tuple[str, ...]:
    """What the thread imports: ``MODULES``, or env COLDSTART_EARLY_IMPORT's comma-separated
    list (empty where it is 0)."""
    v = env.get("COLDSTART_EARLY_IMPORT", "1").strip()
    if v == "0":
        return ()
    if v in ("", "1"):
        return MODULES
    return tuple(m.strip() for m in v.split(",") if m.strip())


def _imports() -> None:
    import importlib
    try:
        for name in modules():
            importlib.import_module(name)
            _times[f"{name}_at"] = time.time()
    except BaseException as e:  # noqa: BLE001 - the constructor imports again and raises it there
        _error.append(e)
    _times["done_at"] = time.time()


def wait(timeout: float | None = None) -> bool:
    """Wait for the import thread, where there is one; whether it is done (True without one)."""
    if _thread is None:
        return True
    _thread.join(timeout)
    return not _thread.is_alive()


def times() -> dict[str, float]:
    """Unix times of the hook's call and of each module's import done (empty without the hook),
    for the replica's /stats: the bench relates them to the deploy."""
    return dict(_times)


def pause_gc(env: os._Environ | dict = os.environ) -> bool:
    """Turn the cyclic garbage collector off until ``resume_gc`` (a replica's own process only:
    the hook, or the deployment's constructor where no hook ran); whether it was turned off
    now. Does nothing where env COLDSTART_PAUSE_GC is 0, where it is off already (someone else
    chose so) or after an earlier pause."""
    if _gc or env.get("COLDSTART_PAUSE_GC", "1").strip() == "0" or not gc.isenabled():
        return False
    gc.disable()
    _gc["paused_at"] = time.time()
    return True


def resume_gc(freeze: bool) -> None:
    """Turn the collector back on after ``pause_gc`` (a no-op otherwise, and the second time);
    ``freeze``: first move every object into its permanent generation (``gc.freeze()``), as the
    replica does once warm: what the start made lives as long as the process."""
    if "paused_at" not in _gc or "resumed_at" in _gc:
        return
    if freeze:
        gc.freeze()
        _gc["frozen"] = gc.get_freeze_count()
    gc.enable()
    _gc["resumed_at"] = time.time()


def gc_state() -> dict[str, float]:
    """For the replica's /stats: how long the collector was paused (``paused_s``, where it has
    been resumed) and how many objects were frozen; empty where it was never paused."""
    out = {}
    if "resumed_at" in _gc:
        out["paused_s"] = round(_gc["resumed_at"] - _gc["paused_at"], 3)
    elif "paused_at" in _gc:
        out["paused_since"] = _gc["paused_at"]
    if "frozen" in _gc:
        out["frozen"] = int(_gc["frozen"])
    return out
