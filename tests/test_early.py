"""deployments.early: a replica's imports from Ray's worker setup hook, without touching CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deployments import early

ROOT = Path(__file__).resolve().parents[1]


def test_modules_follow_the_env_var():
    assert early.modules({}) == early.MODULES
    assert early.modules({"COLDSTART_EARLY_IMPORT": "1"}) == early.MODULES
    assert early.modules({"COLDSTART_EARLY_IMPORT": "0"}) == ()
    assert early.modules({"COLDSTART_EARLY_IMPORT": " torch, json ,"}) == ("torch", "json")


def _run(code: str, **env: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **env})
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
from deployments import early
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
    assert t["hook_at"] <= t["torch_at"] <= t["deployments.engine_at"] <= t["done_at"]


def test_hook_does_nothing_when_turned_off():
    out = _run(_PROBE.replace("early.hook()", "early.hook(); assert early._thread is None"),
               COLDSTART_EARLY_IMPORT="0")
    assert out["times"] == {} and out["imported"] == []


def test_a_failed_import_is_left_to_the_constructor():
    out = _run(_PROBE, COLDSTART_EARLY_IMPORT="json,no_such_module_here")
    assert out["imported"] == ["json"] and "done_at" in out["times"]  # the thread ended, the process goes on
    assert out["errors"] == ["ModuleNotFoundError"]
