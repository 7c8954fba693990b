"""The replica's start (deployments.server.start) and its side threads (deployments.startup)."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deployments.config import DeploymentArgs
from deployments.engine.request import SamplingParams
from deployments.server.start import Start
from deployments.startup import context
from deployments.startup.side import SideTask
from weights.timing import PhaseTimer

ROOT = Path(__file__).resolve().parents[1]


def test_side_task_keeps_result_seconds_and_a_logged_error(caplog):
    ok = SideTask("ok", lambda: 42).wait()
    assert ok.done() and ok.result == 42 and ok.error is None and ok.seconds >= 0

    def boom():
        raise OSError("no such library")
    with caplog.at_level(logging.WARNING, logger="deployments.startup.side"):
        bad = SideTask("bad", boom).wait()
    assert bad.result is None and isinstance(bad.error, OSError)
    assert "bad failed (OSError('no such library'))" in caplog.text


def test_context_only_for_device_zero_and_where_a_driver_is(monkeypatch, tmp_path):
    for dev in ("cpu", "cuda:1"):
        assert context.start(dev) is None
    monkeypatch.setattr(context, "DRIVER_FILE", str(tmp_path / "absent"))
    assert context.start("auto") is None


def test_context_without_libcuda_says_why(monkeypatch, tmp_path, caplog):
    """A node whose /dev/nvidiactl exists but whose libcuda cannot be loaded: the side thread
    gives up, the replica goes on to torch's own start, which reports the real problem."""
    (tmp_path / "nvidiactl").write_text("")
    monkeypatch.setattr(context, "DRIVER_FILE", str(tmp_path / "nvidiactl"))
    monkeypatch.setattr(context, "LIBCUDA", "libcuda-not-here.so.9")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "-")  # (so that what start sets is undone after)
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    with caplog.at_level(logging.WARNING, logger="deployments.startup.side"):
        task = context.start("auto").wait()
    assert isinstance(task.error, OSError) and "libcuda-not-here.so.9" in caplog.text
    # the driver reads it at cuInit: set as torch sets it, before the thread's first call
    import os
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"


def test_the_start_is_one_list_of_named_steps(tiny_packed):
    """The steps run in their order, each a phase; a CPU start loads before it builds."""
    args = DeploymentArgs(model=str(tiny_packed), device="cpu", engine={"max_slots": 2, "max_seq_len": 64})
    timer = PhaseTimer()
    start = Start(args, timer)
    names = [s.name for s in start.steps()]
    assert names == ["ranks", "resolve", "imports", "context", "tp_group", "load_start", "load_first", "engine_model",
                     "engine_tokenizer", "engine_kv_cache", "load_release", "ranks_ready", "engine_graphs",
                     "load_wait", "ranks_loaded"]
    start.run()
    try:
        done = [p.name for p in timer.phases if p.name in names]
        # one device: no tensor-parallel steps; loaded first (CPU): nothing left to wait for at the end
        assert done == ["imports", "context", "load_start", "load_first", "engine_model", "engine_tokenizer",
                        "engine_kv_cache", "engine_graphs"]
        assert {"load", "engine", "constructor"} <= set(timer.as_dict())
        assert start.engine.alive() and start.loaded is not None
    finally:
        start.engine.shutdown()


def test_a_failed_step_stops_what_the_start_started(tiny_packed, monkeypatch):
    args = DeploymentArgs(model=str(tiny_packed), device="cpu", engine={"max_slots": 2, "max_seq_len": 64})
    start = Start(args, PhaseTimer())

    def broken() -> None:
        raise RuntimeError("the graphs broke")
    monkeypatch.setattr(start, "start_engine", broken)
    with pytest.raises(RuntimeError, match="the graphs broke"):
        start.run()
    assert start.engine is not None and not start.engine.alive()
    with pytest.raises(RuntimeError, match="shut down"):
        start.engine.submit([1], SamplingParams(max_new_tokens=1))


_GC_PROBE = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from deployments.config import DeploymentArgs
from deployments.engine.request import SamplingParams
from deployments.server.start import Start
from weights.timing import PhaseTimer
start = Start(DeploymentArgs(model=sys.argv[2], device="cpu", engine={"max_slots": 2, "max_seq_len": 64}),
              PhaseTimer(), own_process=True)
start.run()
paused = not gc.isenabled()
start.finish(warm=True)
print(json.dumps({"paused_during_start": paused, "enabled_after": gc.isenabled(),
                  "frozen": gc.get_freeze_count() > 0}))
start.engine.shutdown()
"""


@pytest.mark.parametrize("pause", ["1", "0"])
def test_own_process_start_freezes_what_it_made_once_warm(tiny_packed, pause):
    """A replica's own process: the collector is paused for the start (unless turned off) and,
    once warm, what the start made is frozen and the collector is on."""
    import os
    out = subprocess.run([sys.executable, "-c", _GC_PROBE, str(ROOT), str(tiny_packed)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "COLDSTART_PAUSE_GC": pause})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"paused_during_start": pause == "1", "enabled_after": True, "frozen": True}


def test_a_plain_process_is_left_alone(tiny_packed):
    args = DeploymentArgs(model=str(tiny_packed), device="cpu", engine={"max_slots": 2, "max_seq_len": 64})
    gc.unfreeze()
    start = Start(args, PhaseTimer()).run()
    try:
        assert gc.isenabled()
        start.finish(warm=True)
        assert gc.get_freeze_count() == 0
    finally:
        start.engine.shutdown()


EARLY_SCRIPT = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
from deployments.startup import context
task = context.start("auto")
import torch
from deployments.device import create_context, choose_device
task.wait()
cuda = ctypes.CDLL("libcuda.so.1")
dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
cuda.cuDeviceGet(ctypes.byref(dev), 0)
cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
before = active.value  # made by the side thread, torch not started yet
d = choose_device("auto")
create_context(d)
x = torch.arange(10, device=d).sum().item()
primary, current = ctypes.c_void_p(), ctypes.c_void_p()
cuda.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev)
cuda.cuCtxGetCurrent(ctypes.byref(current))
print(json.dumps({"ahead": task.seconds, "why_not": task.result, "active_before_torch": before, "sum": x,
                  "torch_in_primary": primary.value == current.value}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_early_context_is_the_one_torch_uses():
    """In a fresh process: the side thread made the device's primary context before torch
    started CUDA, and torch's work runs in that same context."""
    out = subprocess.run([sys.executable, "-c", EARLY_SCRIPT, str(ROOT)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["why_not"] is None and got["ahead"] > 0
    assert got["active_before_torch"] == 1
    assert got["sum"] == 45
    assert got["torch_in_primary"] is True
