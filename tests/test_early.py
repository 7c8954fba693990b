"""deployments.early: a replica's imports from Ray's worker setup hook, without touching CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.startup import early

ROOT = Path(__file__).resolve().parents[1]


def test_modules_follow_the_env_var():
    assert early.modules({}) == early.MODULES
    assert early.modules({"COLDSTART_EARLY_IMPORT": "1"}) == early.MODULES
    assert early.modules({"COLDSTART_EARLY_IMPORT": "0"}) == ()
    assert early.modules({"COLDSTART_EARLY_IMPORT": " torch, json ,"}) == ("torch", "json")


def _run(code: str, **env: str) -> dict:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": path, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# Every way torch reaches the driver is counted: the device count (cudaGetDeviceCount, cuInit
# inside) and the lazy init. The engine's modules, imported as the hook does, must call neither:
# Ray sets the replica's CUDA_VISIBLE_DEVICES only after the hook.
_PROBE = """
import json, sys, time
import torch
calls = []
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    real = getattr(torch._C, name, None)
    if real is not None:
        setattr(torch._C, name, lambda real=real, name=name: calls.append(name) or real())
from deployments.startup import early
early.hook()
assert early.wait(240)
print(json.dumps({"calls": calls, "initialized": torch.cuda.is_initialized(), "times": early.times(),
                  "imported": [m for m in early.modules() if m in sys.modules],
                  "errors": [type(e).__name__ for e in early._error],
                  "cached_count": getattr(torch.cuda, "_cached_device_count", None)}))
"""


def test_hook_imports_the_engine_modules_and_never_calls_cuda():
    out = _run(_PROBE)
    assert out["calls"] == [] and not out["initialized"] and out["cached_count"] is None
    assert out["errors"] == []
    assert out["imported"] == list(early.MODULES)
    t = out["times"]
    assert t["hook_at"] <= t["torch_at"] <= t["deployments.engine.engine_at"] <= t["done_at"]


def test_hook_does_nothing_when_turned_off():
    out = _run(_PROBE.replace("early.hook()", "early.hook(); assert early._thread is None"),
               COLDSTART_EARLY_IMPORT="0")
    assert out["times"] == {} and out["imported"] == []


def test_a_failed_import_is_left_to_the_constructor():
    out = _run(_PROBE, COLDSTART_EARLY_IMPORT="json,no_such_module_here")
    assert out["imported"] == ["json"] and "done_at" in out["times"]  # the thread ended, the process goes on
    assert out["errors"] == ["ModuleNotFoundError"]


_AFTER_HOOK = """
import json, os
os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # as a worker starts: Ray has not chosen its GPU yet
from deployments.startup import early
early.hook()
assert early.wait(240) and not early._error, early._error
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # what Ray sets once the actor arrives (here: no GPU)
import torch
# the CUDA runtime's own count, fixed when the driver was first initialised in this process
# (torch.cuda.device_count() would ask NVML, which reads the variable at every call)
print(json.dumps({"count": torch._C._cuda_getDeviceCount()}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs an NVIDIA driver")
def test_the_devices_a_replica_sees_are_chosen_after_the_hook():
    """Whatever the hook's imports run (torch, Triton, the engine's modules), none may make CUDA
    enumerate the devices: CUDA_VISIBLE_DEVICES set after the hook must still decide them. (The
    control: a process that calls torch.cuda.is_available() before setting it counts its GPU.)"""
    assert _run(_AFTER_HOOK) == {"count": 0}
    control = _AFTER_HOOK.replace("from deployments.startup import early\nearly.hook()\nassert early.wait(240) and not "
                                  "early._error, early._error\n", "import torch\ntorch.cuda.is_available()\n")
    assert control != _AFTER_HOOK and _run(control)["count"] >= 1


_GC = """
import gc, json, os
from deployments.startup import early
before = gc.isenabled()
early.hook()
paused = not gc.isenabled()
assert early.wait(240)
mid = early.gc_state()
import torch  # the start's objects
early.resume_gc(freeze=os.environ.get("FREEZE") == "1")
early.resume_gc(freeze=True)  # a second call changes nothing
print(json.dumps({"before": before, "paused": paused, "mid": sorted(mid), "after": gc.isenabled(),
                  "state": early.gc_state(), "freeze_count": gc.get_freeze_count()}))
"""


def test_the_hook_pauses_the_collector_until_the_replica_resumes_it_and_freezes_the_start():
    out = _run(_GC, FREEZE="1")
    assert out["before"] and out["paused"] and out["after"]
    assert out["mid"] == ["paused_since"]  # while paused, /stats says since when
    assert out["state"]["frozen"] == out["freeze_count"] > 50_000  # torch's objects and more
    assert out["state"]["paused_s"] > 0


def test_a_replica_that_failed_to_start_resumes_the_collector_without_freezing():
    out = _run(_GC)
    assert out["paused"] and out["after"]
    assert out["freeze_count"] == 0 and "frozen" not in out["state"] and out["state"]["paused_s"] > 0


def test_the_collector_is_left_alone_when_turned_off_or_off_already():
    out = _run(_GC, FREEZE="1", COLDSTART_PAUSE_GC="0")
    assert not out["paused"] and out["after"] and out["state"] == {} and out["freeze_count"] == 0
    # someone else turned it off: it stays off, nothing is frozen
    out = _run(_GC.replace("before = gc.isenabled()", "gc.disable(); before = gc.isenabled()"), FREEZE="1")
    assert not out["before"] and not out["after"] and out["state"] == {} and out["freeze_count"] == 0


_TRICKLE = """
import json, sys, time
from deployments.startup import early
from weights import readahead
path, wait = sys.argv[1], float(sys.argv[2])
early.hook()
early.hook()  # a second call starts nothing more
running = bool(readahead._trickles)  # (the helpers the readahead module started in this process)
deadline = time.time() + wait
while readahead.is_cold(path) and time.time() < deadline:
    time.sleep(0.05)
print(json.dumps({"running": running, "helpers": len(readahead._trickles), "cold_after": readahead.is_cold(path)}))
"""


def test_the_hook_starts_reading_cold_weights_it_is_pointed_at(cold_packed, tmp_path):
    """COLDSTART_EARLY_WEIGHTS: the hook starts the trickle of a packed model whose weights are not
    in the page cache, which reads them all; where they are cached already, none."""
    d = cold_packed

    def run(wait: float, **env: str) -> dict:
        r = subprocess.run([sys.executable, "-c", _TRICKLE, str(d), str(wait)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "COLDSTART_EARLY_IMPORT": "0", **env})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert run(1.0, COLDSTART_EARLY_WEIGHTS="") == {"running": False, "helpers": 0, "cold_after": True}
    assert run(120, COLDSTART_EARLY_WEIGHTS=str(d)) == {"running": True, "helpers": 1, "cold_after": False}
    # cached now: the hook starts nothing
    assert run(0, COLDSTART_EARLY_WEIGHTS=str(d)) == {"running": False, "helpers": 0, "cold_after": False}
    try:
        assert early.early_trickle({"COLDSTART_EARLY_WEIGHTS": str(tmp_path / "missing")}) is False
    finally:
        early._times.pop("trickle_at", None)
