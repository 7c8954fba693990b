"""Opening and verifying damaged packed files: a clear error, never tensors of garbage."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from deployments.tools.cli import main as cli
from weights import PackedFormatError, PackOptions, load, pack, read_packed, verify
from weights.format import PREAMBLE_BYTES, encode_preamble


@pytest.fixture
def packed(tiny_packed, tmp_path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(tiny_packed, d)
    return d


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _rewrite_index(d: Path, edit) -> None:
    """Rewrite the index with ``edit(doc)`` applied and a consistent hash and crc."""
    f = d / "model.cst"
    pf = read_packed(d)
    raw = f.read_bytes()
    doc = json.loads(raw[PREAMBLE_BYTES + pf.data_bytes:])
    edit(doc)
    index = json.dumps(doc).encode()
    f.write_bytes(encode_preamble(pf.data_bytes, index) + raw[PREAMBLE_BYTES:PREAMBLE_BYTES + pf.data_bytes]
                  + index)


def test_wrong_magic(packed):
    f = packed / "model.cst"
    f.write_bytes(b"GGUF\x00\x00\x00\x00" + f.read_bytes()[8:])
    with pytest.raises(PackedFormatError, match=r"not a coldstart packed file \(magic b'GGUF"):
        read_packed(packed)


def test_newer_version(packed):
    f = packed / "model.cst"
    raw = bytearray(f.read_bytes())
    struct.pack_into("<I", raw, 8, 2)
    struct.pack_into("<I", raw, PREAMBLE_BYTES - 4, zlib.crc32(bytes(raw[:PREAMBLE_BYTES - 4])))
    f.write_bytes(bytes(raw))
    with pytest.raises(PackedFormatError, match=r"format version 2 is newer than this coldstart reads "
                                                r"\(up to 1\); upgrade coldstart"):
        read_packed(packed)


@pytest.mark.parametrize("keep", [100, PREAMBLE_BYTES + 5000, -1])
def test_truncated(packed, keep):
    f = packed / "model.cst"
    f.write_bytes(f.read_bytes()[:keep])
    with pytest.raises(PackedFormatError, match="truncated"):
        read_packed(packed)


def test_index_entry_outside_the_file(packed):
    def edit(doc):
        doc["tensors"][-1]["offset"] += 1 << 30
    _rewrite_index(packed, edit)
    with pytest.raises(PackedFormatError, match=r"tensor '[\w.]+' spans data bytes \d+\.\.\d+, outside "
                                                r"the \d+-byte data region"):
        read_packed(packed)


def test_misaligned_index_entry(packed):
    def edit(doc):
        doc["tensors"][0]["offset"] += 2
    _rewrite_index(packed, edit)
    with pytest.raises(PackedFormatError, match="is not 4096-aligned"):
        read_packed(packed)


def test_flipped_byte_in_header(packed):
    _flip(packed / "model.cst", 30)
    with pytest.raises(PackedFormatError, match=r"header is corrupt \(preamble crc32 mismatch\)"):
        read_packed(packed)


def test_flipped_byte_in_index(packed):
    pf = read_packed(packed)
    _flip(packed / "model.cst", pf.file_bytes - 20)
    with pytest.raises(PackedFormatError, match=r"index is corrupt \(sha256 mismatch\)"):
        read_packed(packed)


def test_flipped_byte_in_data_named_by_verify_and_load(tiny_hf, tmp_path, capsys):
    # 4 KiB chunks: the bad chunk holds the victim tensor alone
    packed = pack(tiny_hf, tmp_path / "m", PackOptions(chunk_bytes=4096, progress=False))
    pf = read_packed(packed)
    victim = pf.tensors[len(pf.tensors) // 2]
    _flip(packed / "model.cst", PREAMBLE_BYTES + victim.offset + 3)
    report = verify(packed)
    assert not report.ok and len(report.bad_chunks) == 1
    assert f"tensors {victim.name!r})" in report.problems()[0]
    # the loading path catches it too, naming the chunk, the tensor and the file
    with pytest.raises(PackedFormatError, match=rf"model.cst: checksum mismatch in chunk \d+ .*{victim.name}"):
        load(packed, "cpu")
    assert cli(["verify", str(packed)]) == 1
    assert victim.name in capsys.readouterr().err


def test_swapped_blocks_detected(packed):
    # two aligned 4 KiB pages exchanged: a plain sum would not notice, the weighted one does
    pf = read_packed(packed)
    assert pf.data_bytes >= 2 * 4096
    f = packed / "model.cst"
    raw = bytearray(f.read_bytes())
    a, b = PREAMBLE_BYTES, PREAMBLE_BYTES + 4096
    if raw[a:a + 4096] == raw[b:b + 4096]:
        pytest.skip("pages identical")
    raw[a:a + 4096], raw[b:b + 4096] = raw[b:b + 4096], raw[a:a + 4096]
    f.write_bytes(bytes(raw))
    assert not verify(packed).ok


def test_load_without_verify_skips_the_check(packed):
    pf = read_packed(packed)
    _flip(packed / "model.cst", PREAMBLE_BYTES + pf.tensors[0].offset)
    from weights import LoadOptions
    m = load(packed, "cpu", options=LoadOptions(verify=False))
    assert m.timer.get("verify") is None


def test_digest_is_the_index_hash(packed):
    pf = read_packed(packed)
    raw = (packed / "model.cst").read_bytes()
    assert pf.digest == hashlib.sha256(raw[PREAMBLE_BYTES + pf.data_bytes:]).hexdigest()


def test_open_reads_no_data(packed):
    # opening must not touch the data region: zero it and open still succeeds
    pf = read_packed(packed)
    f = packed / "model.cst"
    raw = bytearray(f.read_bytes())
    raw[PREAMBLE_BYTES:PREAMBLE_BYTES + pf.data_bytes] = bytes(pf.data_bytes)
    f.write_bytes(bytes(raw))
    assert read_packed(packed).digest == pf.digest
