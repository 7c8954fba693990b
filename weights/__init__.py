"""The packed weight format and everything that touches it.

Public API::

    pack(src, dest, PackOptions(...))     HF model directory -> packed directory (tp=N: one per rank)
    verify(dest) -> VerifyReport          structure + every chunk checksum (of every rank)
    read_packed(dest) -> PackedFile       preamble + index only (reads no data)
    load(dest, device=None) -> LoadedModel  one device buffer (GPU if any, else CPU), views
    load(dest, rank=K)                    rank K's part of a split pack (``weights.tp``: the rules)
    prefetch(dest)                        read-ahead into the page cache, no torch import
    make_demo(dest, shape)                a random Llama checkpoint in HF format

``weights.readahead``, ``weights.format`` and ``weights.options`` import no torch; the rest import it
lazily through this package's attributes, so ``import weights`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "pack": "packer", "PackOptions": "packer",
    "verify": "verifier", "VerifyReport": "verifier",
    "read_packed": "format", "PackedFile": "format", "PackedFormatError": "format",
    "TensorParallelPackError": "format",
    "load": "loader", "LoadOptions": "options", "LoadedModel": "loader",
    "DeviceMemoryError": "loader",
    "prefetch": "readahead",
    "make_demo": "demo",
    "PhaseTimer": "timing",
    "SourceError": "sources",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'weights' has no attribute {name!r}")
