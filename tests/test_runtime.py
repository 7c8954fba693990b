"""Replica runtime set-up: device choice and preflight messages (CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from deployments.runtime import (PreflightError, check_driver, check_env, choose_device,
                                 create_context, process_start_time)

PROC = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {v}  Release Build  "
        "(dvs-builder@U22)  Mon Jul 14 2025\nGCC version:  gcc version 12.3.0\n")


def test_driver_too_old_for_torch_cuda_fails_with_both_versions():
    with pytest.raises(PreflightError, match=r"driver 450.80.02 is older than .*torch is built "
                                             r"for CUDA 13.0.*install driver >="):
        check_driver(PROC.format(v="450.80.02"), "13.0")


def test_recent_driver_passes_and_unknown_is_not_an_error():
    assert check_driver(PROC.format(v="580.159.04"), "13.0") == "580.159.04"
    assert check_driver(None, "13.0") is None          # no /proc file: cannot tell
    assert check_driver(PROC.format(v="580.159.04"), None) == "580.159.04"  # CPU torch


def test_cpu_and_auto_without_gpu():
    assert choose_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert choose_device("auto").type == "cpu"
        with pytest.raises(PreflightError, match="no GPU is usable|CPU-only build"):
            choose_device("cuda")
        assert create_context(torch.device("cpu"))["device"] == "cpu"


def test_env_warning(monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    assert any("CUDA_MODULE_LOADING" in w for w in check_env())
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    assert check_env() == []


def test_process_start_time_is_before_now():
    t = process_start_time()
    assert t is not None and t <= time.time()


@pytest.fixture
def fresh_early(monkeypatch):
    """runtime's record of the side thread, empty for the test and put back after it."""
    from deployments import runtime
    monkeypatch.setattr(runtime, "_EARLY", {})
    return runtime


def test_early_context_only_for_device_zero_and_where_a_driver_is(fresh_early, monkeypatch):
    rt = fresh_early
    for dev in ("cpu", "cuda:1"):
        assert rt.start_context(dev) is None
    monkeypatch.setenv("COLDSTART_EARLY_CONTEXT", "0")
    monkeypatch.setattr(rt, "_driver_present", lambda: True)
    assert rt.start_context("auto") is None
    assert rt.early_context() is None  # nothing started: nothing to wait for


def test_early_context_without_libcuda_does_nothing_and_says_why(fresh_early, monkeypatch, caplog):
    """A node whose /dev/nvidiactl exists but whose libcuda cannot be loaded: the side thread
    gives up, the replica goes on to torch's own start, which reports the real problem."""
    rt = fresh_early
    monkeypatch.setattr(rt, "_driver_present", lambda: True)

    def no_libcuda():
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(rt, "_libcuda", no_libcuda)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "-")  # (so that what start_context sets is undone after)
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    t = rt.start_context("auto")
    assert t is not None
    import logging
    with caplog.at_level(logging.INFO, logger="deployments.runtime"):
        assert rt.early_context() is None
    assert "libcuda.so.1: cannot open shared object file" in caplog.text
    # the driver reads it at cuInit: set as torch sets it, before the thread's first call
    assert rt.os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    assert rt.start_context("auto") is None  # once per process


EARLY_SCRIPT = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
from deployments.runtime import start_context, early_context, create_context, choose_device
start_context("auto")
import torch
ahead = early_context()
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
print(json.dumps({"ahead": ahead, "active_before_torch": before, "sum": x,
                  "torch_in_primary": primary.value == current.value}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_early_context_is_the_one_torch_uses(tmp_path):
    """In a fresh process: the side thread made the device's primary context before torch
    started CUDA, and torch's work runs in that same context."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", EARLY_SCRIPT, str(root)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["ahead"] is not None and got["ahead"] > 0
    assert got["active_before_torch"] == 1
    assert got["sum"] == 45
    assert got["torch_in_primary"] is True
