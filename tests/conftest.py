"""Shared fixtures: real checkpoints made on the spot (random weights, a trained tokenizer)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from weights import PackOptions, make_demo, pack

HAS_CUDA = torch.cuda.is_available()


def gpu(f):
    """Mark a test as needing CUDA (``-m gpu`` selects them); skipped cleanly without one."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(f))


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return make_demo(tmp_path_factory.mktemp("hf") / "tiny", "tiny")


@pytest.fixture(scope="session")
def small_hf(tmp_path_factory) -> Path:
    """bf16, two safetensors shards with an index."""
    return make_demo(tmp_path_factory.mktemp("hf") / "small", "small")


@pytest.fixture(scope="session")
def tiny_packed(tiny_hf, tmp_path_factory) -> Path:
    return pack(tiny_hf, tmp_path_factory.mktemp("packed") / "tiny", PackOptions(progress=False))


@pytest.fixture
def cold_packed(tiny_packed, tmp_path) -> Path:
    """A copy of the tiny packed model whose weights are not in the page cache (skipped where the
    filesystem keeps the pages despite POSIX_FADV_DONTNEED)."""
    import shutil

    from deployments.tools.doctor import drop_page_cache
    from weights import readahead

    d = tmp_path / "cold"
    shutil.copytree(tiny_packed, d)
    drop_page_cache([d / "model.cst"])
    if not readahead.is_cold(d):
        pytest.skip("this filesystem kept the pages despite POSIX_FADV_DONTNEED")
    return d


_ST = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
       torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], raw_dtypes: dict | None = None
                      ) -> Path:
    """A safetensors file written by hand (the format is 8 bytes + JSON + data).

    ``raw_dtypes`` overrides a tensor's dtype code (to write codes torch lacks).
    """
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        code = (raw_dtypes or {}).get(name, _ST.get(t.dtype))
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def make_hf_dir(root: Path, shards: list[dict[str, torch.Tensor]], config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or {"architectures": ["Custom"]}))
    for i, sd in enumerate(shards):
        write_safetensors(root / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", sd)
    return root


def rewrite_index(d: Path, edit) -> None:
    """Rewrite a packed model's index with ``edit(doc)`` applied, and a consistent hash and crc
    (a file as another coldstart, or an older one, would have written it)."""
    from weights.format import PREAMBLE_BYTES, encode_preamble, read_packed

    f = d / "model.cst"
    pf = read_packed(d)
    raw = f.read_bytes()
    doc = json.loads(raw[PREAMBLE_BYTES + pf.data_bytes:])
    edit(doc)
    index = json.dumps(doc).encode()
    f.write_bytes(encode_preamble(pf.data_bytes, index) + raw[PREAMBLE_BYTES:PREAMBLE_BYTES + pf.data_bytes]
                  + index)
