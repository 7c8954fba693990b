"""A replica's imports from its process's first moments, beside Ray's own start of the worker.

Between the controller asking for a replica and the replica's constructor, Ray starts a
worker process, imports itself, connects to the node, receives the actor, imports Serve's
replica and unpickles the deployment's class: seconds (docs/measurements.md) in which the
process waits on its node as much as it computes. Ray runs a worker's *setup hook* right after
the worker connects, before it takes the actor: serve_config.yaml names ``hook`` there
(``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR``; Ray's ``runtime_env.worker_process_setup_hook``
field sets that variable for a job's workers only, not for one application's replicas), and
the hook starts a thread that imports torch and the engine's modules while Ray's main thread
goes on. The constructor's own imports then find them done, or wait for the rest.

Nothing here may touch the GPU: Ray sets CUDA_VISIBLE_DEVICES when the actor arrives, after
the hook, and CUDA fixes the devices a process sees at its first call (``cuInit``). So the
thread imports modules only, none of which calls CUDA at import. The bytecode cache
(``deployments.startup.bytecode``) is turned on first, as the constructor would: where the
packages carry no ``.pyc`` files, Ray's own imports after the hook then read compiled modules
too. COLDSTART_EARLY_IMPORT picks what is imported (0: nothing). A hook that fails never fails
the worker: the constructor's imports raise the error where the replica reports it.

The hook also turns Python's cyclic garbage collector off for the start (``pause_gc``): the
start makes a few hundred thousand long-lived objects (torch, Ray, the engine), and each full
collection the imports trigger walks all of them again, as does the ``gc.collect()`` Ray runs
after the first ``reconfigure``. Once the replica is warm, ``resume_gc(freeze=True)`` moves every
object into the collector's permanent generation (``gc.freeze()``: never walked again) and turns
it back on. A replica that fails to start turns it back on without freezing. COLDSTART_PAUSE_GC=0
leaves the collector on. This module and the replica's start (``deployments.server.start``) are
the only code that starts side threads or touches the collector.

Where COLDSTART_EARLY_WEIGHTS names the packed model and its weights are mostly not in the page
cache (a new node), the hook also starts their trickle (``weights.readahead.trickle``: a helper
process reading the file one piece at a time), which the replica's start would otherwise begin
in its constructor, seconds later; the constructor finds it running and goes on with it, and the
loader stops it when its own reads begin.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Mapping

from deployments import envs

ENV_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
"""Where Ray's worker (ray/_private/workers/default_worker.py) looks for its setup hook: a
``module.function`` path it imports and calls once connected."""
HOOK = "deployments.startup.early.hook"

# the engine's modules (what the replica's start imports, deployments.server.start): none of them
# calls CUDA at import
MODULES = ("torch", "deployments.engine.engine", "deployments.engine.tokenizer", "deployments.model", "weights.loader",
           "jinja2.sandbox")

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
    early_trickle()
    if _thread is not None or not modules():
        return
    _times["hook_at"] = time.time()
    try:
        from deployments.startup import bytecode
        bytecode.enable()  # what the replica's constructor turns on before its imports
    except Exception:  # noqa: BLE001 - no cache: the imports compile, as without the hook
        pass
    _thread = threading.Thread(target=_imports, name="coldstart-early-import", daemon=True)
    _thread.start()


def early_trickle(env: Mapping[str, str] | None = None) -> bool:
    """Start the trickle of COLDSTART_EARLY_WEIGHTS's weights where they are mostly not in the page
    cache (once per process: the readahead module keeps one helper per file); whether one runs now.
    A missing or unreadable model starts nothing: the constructor reports it."""
    path = envs.read("COLDSTART_EARLY_WEIGHTS", env)
    if not path or "trickle_at" in _times:
        return False
    _times["trickle_at"] = time.time()
    try:
        from weights.readahead import is_cold, trickle
        return is_cold(path) and trickle(path) is not None
    except Exception:  # noqa: BLE001 - no early read: the constructor starts its own
        return False


def modules(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """What the thread imports: ``MODULES``, or COLDSTART_EARLY_IMPORT's comma-separated list
    (empty where it is 0)."""
    v = envs.read("COLDSTART_EARLY_IMPORT", env)
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


def pause_gc(env: Mapping[str, str] | None = None) -> bool:
    """Turn the cyclic garbage collector off until ``resume_gc`` (a replica's own process only:
    the hook, or the deployment's constructor where no hook ran); whether it was turned off
    now. Does nothing where env COLDSTART_PAUSE_GC is 0, where it is off already (someone else
    chose so) or after an earlier pause."""
    if _gc or not envs.read("COLDSTART_PAUSE_GC", env) or not gc.isenabled():
        return False
    gc.disable()
    _gc["paused_at"] = time.time()
    return True


def gc_paused() -> bool:
    """Whether ``pause_gc`` turned the collector off and ``resume_gc`` has not turned it back on."""
    return "paused_at" in _gc and "resumed_at" not in _gc


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
