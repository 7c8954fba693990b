"""Opening and verifying damaged packed files: a clear error, never tensors of garbage."""

from __future__ import annotations

import hashlib
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from conftest import gpu, rewrite_index
from deployments.tools.cli import main as cli
from weights import PackedFormatError, PackOptions, load, pack, read_packed, verify
from weights.format import PREAMBLE_BYTES
from weights.loader import start_load


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
    rewrite_index(packed, edit)
    with pytest.raises(PackedFormatError, match=r"tensor '[\w.]+' spans data bytes \d+\.\.\d+, outside "
                                                r"the \d+-byte data region"):
        read_packed(packed)


def test_misaligned_index_entry(packed):
    def edit(doc):
        doc["tensors"][0]["offset"] += 2
    rewrite_index(packed, edit)
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


# ---- side files: every file the pack copied is under the index's sha256 ----

SAME_SIZE_EDITS = [
    ("config.json", b'"rope_theta": 10000.0', b'"rope_theta": 10000.5'),
    ("generation_config.json", b'"eos_token_id": 2', b'"eos_token_id": 4'),
    ("tokenizer.json", b'"content": "<unk>"', b'"content": "<unK>"'),
    ("tokenizer_config.json", b"[INST]", b"[IN5T]"),
]


def _edit(path: Path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    assert old in raw
    path.write_bytes(raw.replace(old, new, 1))


def test_index_lists_every_side_file_with_its_sha256(packed):
    listed = read_packed(packed).index.side_files
    on_disk = sorted(p.name for p in packed.iterdir() if p.name != "model.cst")
    assert sorted(listed) == on_disk and "tokenizer.json" in listed
    for name, entry in listed.items():
        raw = (packed / name).read_bytes()
        assert (entry.sha256, entry.bytes) == (hashlib.sha256(raw).hexdigest(), len(raw))


@pytest.mark.parametrize("name, old, new", SAME_SIZE_EDITS)
def test_a_changed_side_file_fails_verify_and_load(packed, capsys, name, old, new):
    """One changed value, same size (rope_theta, eos id, a token, the chat template): verify
    fails naming the file and the fix; the load refuses it before reading any weight byte."""
    _edit(packed / name, old, new)
    report = verify(packed)
    assert not report.ok and report.bad_chunks == []
    assert len(report.problems()) == 1
    assert str(packed / name) in report.problems()[0]
    assert "changed since packing" in report.problems()[0] and "re-pack" in report.problems()[0]
    with pytest.raises(PackedFormatError, match=rf"{name}: changed since packing \(sha256"):
        load(packed, "cpu")
    assert cli(["verify", str(packed)]) == 1
    err = capsys.readouterr().err
    assert str(packed / name) in err and "FAILED" in err


def test_side_files_are_checked_before_any_weight_byte(packed):
    """A bad side file and a bad data chunk: the load names the side file (checked up front,
    from the index alone), not the chunk (found only by reading the data)."""
    pf = read_packed(packed)
    _flip(packed / "model.cst", PREAMBLE_BYTES + pf.tensors[0].offset)
    (packed / "config.json").write_text((packed / "config.json").read_text() + "\n")
    with pytest.raises(PackedFormatError, match=r"config.json: changed since packing \(\d+ bytes, "
                                                r"the index says \d+\)"):
        load(packed, "cpu")


def test_a_missing_or_extra_side_file_fails_verify_and_load(packed):
    (packed / "tokenizer.json").unlink()
    (packed / "chat_template.jinja").write_text("{{ messages }}")
    problems = verify(packed).problems()
    assert len(problems) == 2
    assert str(packed / "tokenizer.json") in problems[0] and "missing" in problems[0]
    assert str(packed / "chat_template.jinja") in problems[1]
    assert "does not list it" in problems[1] and "remove it" in problems[1]
    with pytest.raises(PackedFormatError, match=r"tokenizer.json: missing.*chat_template.jinja"):
        load(packed, "cpu")


def _unprotected(d: Path) -> None:
    """``d`` as packed before side-file checksums: its index has no side_files."""
    rewrite_index(d, lambda doc: doc.pop("side_files"))


def test_a_pack_from_before_side_file_checksums_still_loads_and_verifies(packed, capsys, caplog):
    _unprotected(packed)
    _edit(packed / "config.json", b"10000.0", b"10000.5")  # unprotected: not noticed
    assert read_packed(packed).index.side_files is None
    report = verify(packed)
    assert report.ok and report.problems() == []
    assert len(report.notes) == 1 and "not protected" in report.notes[0]
    assert "re-pack" in report.notes[0]
    with caplog.at_level("WARNING", logger="weights"):
        load(packed, "cpu")
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "not protected" in warned[0].getMessage()
    assert str(packed) in warned[0].getMessage() and "re-pack" in warned[0].getMessage()
    assert cli(["verify", str(packed)]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ok: ") and "note:" in out.err and "not protected" in out.err


def test_readers_ignore_index_keys_they_do_not_know(packed):
    """What keeps older readers reading newer files (as they read side_files): unknown keys."""
    rewrite_index(packed, lambda doc: doc.update(some_future_field={"x": [1, 2]}))
    assert verify(packed).ok and load(packed, "cpu").tensors


@pytest.mark.parametrize("bad", [
    [1, 2], {"config.json": {"sha256": "ab", "bytes": 3}}, {"config.json": {"bytes": 3}},
    {"../config.json": {"sha256": "0" * 64, "bytes": 3}}, {"config.json": {"sha256": "0" * 64, "bytes": -1}},
])
def test_a_malformed_side_files_entry_is_refused(packed, bad):
    rewrite_index(packed, lambda doc: doc.update(side_files=bad))
    with pytest.raises(PackedFormatError, match="side_files"):
        read_packed(packed)


@gpu
def test_gpu_load_refuses_a_changed_side_file(packed):
    _edit(packed / "generation_config.json", b'"eos_token_id": 2', b'"eos_token_id": 4')
    with pytest.raises(PackedFormatError, match="generation_config.json: changed since packing"):
        start_load(packed, "cuda")
