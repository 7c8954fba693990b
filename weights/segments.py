"""One plain device segment for the big buffers made once (the weights', the KV cache), where
torch's caching allocator otherwise uses expandable segments."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Iterator, Mapping

import torch

log = logging.getLogger(__name__)


def _alloc_conf(env: Mapping[str, str]) -> str:
    """The allocator settings torch read: PYTORCH_ALLOC_CONF (torch >= 2.9), else
    PYTORCH_CUDA_ALLOC_CONF (the doctor's env check reads them alike, without importing this)."""
    return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""


_EXPANDABLE_ON = re.compile(r"expandable_segments\s*:\s*true", re.IGNORECASE)


def expandable_segments_on(env: Mapping[str, str] | None = None) -> bool:
    """Whether torch's caching allocator was told to use expandable segments (the deployment's
    allocator settings have ``expandable_segments:True``)."""
    return bool(_EXPANDABLE_ON.search(_alloc_conf(os.environ if env is None else env)))


@contextlib.contextmanager
def one_segment(device: torch.device) -> Iterator[None]:
    """Allocate the tensors made inside as plain device segments even where the allocator uses
    expandable segments, then put the settings back.

    Expandable segments keep the many activations of varying sizes from fragmenting memory,
    but they map a tensor's memory piece by piece, which makes a large tensor several times
    slower to allocate and zero (docs/measurements.md). The weights' buffer and the KV cache are
    made once and never grow, so they gain nothing from expandable segments. The deployment's
    whole settings string is given both times, with only expandable_segments changed inside
    (torch resets the options a settings string leaves out). Does nothing on the CPU, where they are off, or where this torch cannot change the
    settings at run time."""
    conf = _alloc_conf(os.environ)
    setter = None
    if device.type == "cuda" and _EXPANDABLE_ON.search(conf):
        setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                  or getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None))
    if setter is not None:
        try:
            setter(_EXPANDABLE_ON.sub("expandable_segments:False", conf))
        except (RuntimeError, ValueError) as e:
            log.info("allocator settings not changed at run time (%s): expandable segments stay on", e)
            setter = None
    try:
        yield
    finally:
        if setter is not None:
            setter(conf)
