"""A damaged safetensors shard is refused as the safetensors library refuses it, naming the file
and what is wrong, before anything is packed.

Each case edits a real shard (written by ``conftest.write_safetensors``, as a checkpoint's
would be: header padded to 8 bytes, then the tensors' bytes back to back)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import SafetensorError, safe_open

from conftest import make_hf_dir
from weights import SourceError, pack
from weights.sources import SafetensorsFile

SHARD = "model-00001-of-00001.safetensors"
# three tensors, fp32 / fp16 / fp32; the names make the JSON header 3 bytes short of a multiple
# of 8, so the shard carries whitespace padding after it
TENSORS = {"alpha": torch.arange(6, dtype=torch.float32), "beta": torch.arange(4, dtype=torch.float16),
           "gamma": torch.ones(2, 3)}


def _parts(raw: bytes) -> tuple[int, dict, bytes]:
    (hlen,) = struct.unpack("<Q", raw[:8])
    return hlen, json.loads(raw[8:8 + hlen]), raw[8 + hlen:]


def _build(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _edit_header(edit: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    """An edit of the header's entries, written back with a header length that matches."""
    def apply(raw: bytes) -> bytes:
        _, header, data = _parts(raw)
        edit(header)
        return _build(header, data)
    return apply


def _length_field(delta: int) -> Callable[[bytes], bytes]:
    def apply(raw: bytes) -> bytes:
        hlen, _, _ = _parts(raw)
        return struct.pack("<Q", hlen + delta) + raw[8:]
    return apply


def _shift_from(name: str, by: int, data_edit: Callable[[bytes, int], bytes]):
    """Move ``name`` and every tensor after it ``by`` bytes; ``data_edit(data, at)`` changes the
    data to match (``at``: where ``name`` started)."""
    def apply(raw: bytes) -> bytes:
        _, header, data = _parts(raw)
        at = header[name]["data_offsets"][0]
        for e in header.values():
            if e["data_offsets"][0] >= at:
                e["data_offsets"] = [v + by for v in e["data_offsets"]]
        return _build(header, data_edit(data, at))
    return apply


def _padding(raw: bytes) -> int:
    hlen, _, _ = _parts(raw)
    text = raw[8:8 + hlen]
    return len(text) - len(text.rstrip(b" "))


CASES = {
    # the header-length field lowered within the header's trailing padding (a flipped low bit):
    # the JSON still parses, and every tensor would be read one or two bytes early
    "length lowered by 1": (_length_field(-1), r"not fully covered by its tensors: with the header-length "
                            r"field's \d+ bytes the tensors' data would end at byte (\d+), the file has \d+"),
    "length lowered by 2": (_length_field(-2), r"not fully covered by its tensors"),
    "length beyond the file": (_length_field(1 << 20), r"header-length field says \d+ bytes, the file has \d+ "
                               r"after the field"),
    "length over the limit": (_length_field(200 << 20), r"more than the \d+ a header may have"),
    "a gap between tensors": (_shift_from("beta", 4, lambda d, at: d[:at] + bytes(4) + d[at:]),
                              r"tensor 'beta' starts at data byte 28, but tensor 'alpha' ends at 24 \(the data "
                              r"region's bytes 24\.\.28 belong to no tensor\)"),
    "overlapping tensors": (_shift_from("beta", -4, lambda d, at: d[:at - 4] + d[at:]),
                            r"tensor 'beta' starts at data byte 20, but tensor 'alpha' ends at 24 \(it "
                            r"overlaps tensor 'alpha' by 4 bytes\)"),
    "data not from byte 0": (_shift_from("alpha", 8, lambda d, at: bytes(8) + d),
                             r"tensor 'alpha' starts at data byte 8, but the data region starts at 0"),
    "bytes after the last tensor": (lambda raw: raw + bytes(16), r"not fully covered by its tensors"),
    "length not shape times dtype": (_edit_header(lambda h: h["gamma"].update(shape=[2, 2])),
                                     r"tensor 'gamma' has 24 bytes for shape \[2, 2\] of F32 \(16 expected\)"),
    "offsets reversed": (_edit_header(lambda h: h["beta"].update(data_offsets=h["beta"]["data_offsets"][::-1])),
                         r"tensor 'beta': data_offsets \[32, 24\] is not \[start, end\] with 0 <= start <= end"),
    "negative dimension": (_edit_header(lambda h: h["alpha"].update(shape=[-6])),
                           r"tensor 'alpha': shape \[-6\] is not a list of non-negative integers"),
    "header not an object": (lambda raw: _build_raw(b"[1, 2]", _parts(raw)[2]),
                             r"safetensors header is a JSON list, not an object of tensors"),
    "metadata not strings": (_edit_header(lambda h: h.update(__metadata__={"format": 1})),
                             r"__metadata__ is not a map of strings to strings"),
}


def _build_raw(text: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text + data


@pytest.fixture
def shard_src(tmp_path) -> Path:
    src = make_hf_dir(tmp_path / "src", [TENSORS])
    raw = (src / SHARD).read_bytes()
    assert _padding(raw) >= 2  # the length-field cases lower it within the padding
    return src


def test_the_intact_shard_reads_the_same_here_and_in_the_library(shard_src):
    ours = SafetensorsFile(shard_src / SHARD)
    with safe_open(shard_src / SHARD, "pt") as lib:
        for name in TENSORS:
            assert torch.equal(ours.get(name), lib.get_tensor(name))
    ours.close()


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_header_is_refused_here_as_by_the_library(shard_src, tmp_path, case):
    edit, msg = CASES[case]
    shard = shard_src / SHARD
    shard.write_bytes(edit(shard.read_bytes()))
    with pytest.raises(SafetensorError):  # parity: the library refuses the same file
        with safe_open(shard, "pt") as lib:
            for name in lib.keys():
                lib.get_tensor(name)
    with pytest.raises(SourceError) as e:
        pack(shard_src, tmp_path / "p")
    text = str(e.value)
    assert text.startswith(f"{shard}: ") and re.search(msg, text), text
    assert text.endswith("download the shard again from the model's source"), text
    assert not (tmp_path / "p").exists()
