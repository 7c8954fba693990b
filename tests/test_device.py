"""deployments.device: device choice and preflight messages (CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from deployments.device import (PreflightError, check_driver, check_env, choose_device,
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


def test_gpu_expected_without_calling_cuda(monkeypatch):
    from deployments.device import gpu_expected
    assert not gpu_expected("cpu")
    assert gpu_expected("cuda") and gpu_expected("cuda:1")
    monkeypatch.setattr("os.path.exists", lambda p: p == "/dev/nvidiactl")
    assert gpu_expected("auto")
    monkeypatch.setattr("os.path.exists", lambda p: False)
    assert not gpu_expected("auto")
