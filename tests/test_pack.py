"""pack -> verify -> load returns every tensor bit-exactly; every bad input has a clear error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_hf_dir, write_safetensors
from weights import PackOptions, SourceError, load, pack, read_packed, verify
from weights.format import ALIGN, WEIGHTS_FILE


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaNs and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _source_tensors(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    f = torch.randn(300, 37, generator=g)
    return {
        "f64": torch.randn(33, generator=g, dtype=torch.float64),
        "f32.odd": f,                                     # 44400 bytes: spans 8 KiB chunks
        "f16": f.half(),
        "bf16": f.bfloat16(),
        "f8.e4m3": f.clamp(-4, 4).to(torch.float8_e4m3fn),
        "f8.e5m2": f.to(torch.float8_e5m2),
        "i64": torch.randint(-2**62, 2**62, (17,), generator=g),
        "i32": torch.randint(-2**31, 2**31 - 1, (5, 7), generator=g, dtype=torch.int32),
        "i16": torch.randint(-2**15, 2**15 - 1, (3,), generator=g, dtype=torch.int16),
        "q.int8": torch.randint(-128, 127, (4097,), generator=g, dtype=torch.int8),
        "q.uint8": torch.randint(0, 255, (1,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "special": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
    }


def test_roundtrip_sharded_bf16(small_hf, tmp_path):
    dest = pack(small_hf, tmp_path / "p", PackOptions(progress=False))
    src = _source_tensors(small_hf)
    m = load(dest, "cpu")
    assert set(m.tensors) == set(src)
    for name, t in src.items():
        assert _same(m.tensors[name], t), name
    assert verify(dest).ok
    # the packed directory alone serves the model
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (dest / f).read_bytes() == (small_hf / f).read_bytes()


def test_roundtrip_every_dtype_across_chunk_boundaries(tmp_path):
    tensors = _all_dtypes()
    names = list(tensors)
    src = make_hf_dir(tmp_path / "src", [{k: tensors[k] for k in names[:7]},
                                         {k: tensors[k] for k in names[7:]}])
    dest = pack(src, tmp_path / "p", PackOptions(chunk_bytes=8192, progress=False))
    pf = read_packed(dest)
    assert len(pf.index.chunk_sums) > 4  # really several chunks
    assert all(t.offset % ALIGN == 0 for t in pf.tensors)
    m = load(dest, "cpu")
    for name, t in tensors.items():
        assert _same(m.tensors[name], t), name
    # tensors are views of one buffer, not copies
    base = m.buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in m.tensors.values())


def test_cast_dtype_keeps_ints_and_fp8(tmp_path):
    tensors = _all_dtypes()
    src = make_hf_dir(tmp_path / "src", [tensors])
    m = load(pack(src, tmp_path / "p", PackOptions(dtype="float16", progress=False)), "cpu")
    assert _same(m.tensors["f32.odd"], tensors["f32.odd"].half())
    assert _same(m.tensors["bf16"], tensors["bf16"].half())
    assert _same(m.tensors["f8.e4m3"], tensors["f8.e4m3"])   # quantized stays quantized
    assert _same(m.tensors["q.int8"], tensors["q.int8"])


def test_bin_checkpoint_with_tied_weights(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    emb = torch.randn(10, 4)
    torch.save({"embed.weight": emb, "lm_head.weight": emb, "norm": torch.ones(4)},
               src / "pytorch_model.bin")
    dest = pack(src, tmp_path / "p", PackOptions(progress=False))
    pf = read_packed(dest)
    assert pf.index.aliases == {"lm_head.weight": "embed.weight"}
    m = load(dest, "cpu")
    assert _same(m.tensors["lm_head.weight"], emb)
    assert m.tensors["lm_head.weight"].data_ptr() == m.tensors["embed.weight"].data_ptr()


def test_bin_with_code_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Evil()}))
    with pytest.raises(SourceError, match="weights_only=True"):
        pack(src, tmp_path / "p")


# ---- bad input: each a clear error, and no DEST left behind ----

def test_missing_src(tmp_path):
    with pytest.raises(SourceError, match="no such directory"):
        pack(tmp_path / "nope", tmp_path / "p")


def test_empty_src(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(SourceError, match="the directory is empty"):
        pack(tmp_path / "src", tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_no_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", {"w": torch.ones(2)})
    with pytest.raises(SourceError, match="no config.json"):
        pack(src, tmp_path / "p")


@pytest.mark.parametrize("name, text, msg", [
    ("config.json", "{bad", r"config.json: not valid JSON \(Expecting property name .*line 1 column 2"),
    ("config.json", "[1]", "config.json: holds a JSON list, not an object"),
    ("generation_config.json", b"\xff\xfe{", "generation_config.json: not valid JSON .*can't decode byte 0xff"),
    ("tokenizer_config.json", '{"bos_token": "<s>",', "tokenizer_config.json: not valid JSON"),
    ("special_tokens_map.json", '"<s>"', "special_tokens_map.json: holds a JSON str, not an object"),
    ("tokenizer.json", '{"version": "1.0"}', "tokenizer.json: the tokenizers library cannot read it"),
])
def test_a_side_file_a_replica_could_not_read_is_refused(tiny_hf, tmp_path, name, text, msg):
    """A side file that is not what a replica reads is refused at pack time, naming it; no DEST."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    (src / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SourceError, match=msg) as e:
        pack(src, tmp_path / "p")
    assert "copy it again from the model's source" in str(e.value)
    assert not (tmp_path / "p").exists()


def test_no_weights(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with pytest.raises(SourceError, match=r"no weights \(\*.safetensors or \*.bin"):
        pack(src, tmp_path / "p")


def test_unsupported_dtype_safetensors(tmp_path):
    src = make_hf_dir(tmp_path / "src", [])
    write_safetensors(src / "model.safetensors", {"ok": torch.ones(2), "odd": torch.ones(2, dtype=torch.int16)},
                      raw_dtypes={"odd": "U16"})
    with pytest.raises(SourceError, match=r"tensor 'odd' has dtype U16, which a packed file cannot hold"):
        pack(src, tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_unsupported_dtype_bin(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    torch.save({"c": torch.ones(2, dtype=torch.complex64)}, src / "pytorch_model.bin")
    with pytest.raises(SourceError, match=r"tensor 'c' has dtype complex64"):
        pack(src, tmp_path / "p")


def test_unsupported_cast_option():
    with pytest.raises(ValueError, match=r"dtype='int4' is not supported"):
        PackOptions(dtype="int4")


def test_same_name_in_two_shards(tmp_path):
    src = make_hf_dir(tmp_path / "src", [{"a": torch.ones(2), "w": torch.ones(3)},
                                         {"w": torch.zeros(3)}])
    with pytest.raises(SourceError, match=r"tensor 'w' is in both model-00001-of-00002.safetensors "
                                          r"and model-00002-of-00002.safetensors"):
        pack(src, tmp_path / "p")


def test_truncated_shard(tmp_path):
    src = make_hf_dir(tmp_path / "src", [{"a": torch.ones(1000)}, {"b": torch.ones(1000)}])
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(SourceError, match=r"model-00002-of-00002.safetensors: truncated: tensor 'b'"):
        pack(src, tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_dest_exists_needs_force(tiny_hf, tmp_path):
    dest = pack(tiny_hf, tmp_path / "p", PackOptions(progress=False))
    digest = read_packed(dest).digest
    with pytest.raises(FileExistsError, match="pass --force"):
        pack(tiny_hf, dest, PackOptions(chunk_bytes=8192, progress=False))
    assert read_packed(dest).digest == digest
    pack(tiny_hf, dest, PackOptions(chunk_bytes=8192, force=True, progress=False))
    assert read_packed(dest).digest != digest and verify(dest).ok
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no temporary left


def test_force_replaces_an_empty_directory(tiny_hf, tmp_path):
    (tmp_path / "p").mkdir()
    with pytest.raises(FileExistsError, match="pass --force"):
        pack(tiny_hf, tmp_path / "p")
    assert verify(pack(tiny_hf, tmp_path / "p", PackOptions(force=True, progress=False))).ok


def _not_a_model(root: Path, kind: str) -> Path:
    d = root / "p"
    if kind == "file":
        d.write_text("mine")
        return d
    d.mkdir()
    (d / ("model.cst" if kind == "foreign model.cst" else "keep")).write_text("mine")
    return d


@pytest.mark.parametrize("kind", ["directory", "foreign model.cst", "file"])
@pytest.mark.parametrize("force", [False, True])
def test_force_never_replaces_what_is_not_a_packed_model(tiny_hf, tmp_path, kind, force):
    """--force replaces a packed model or an empty directory, nothing else; the refusal does not
    suggest --force, since it would not help."""
    dest = _not_a_model(tmp_path, kind)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match=r"p exists and is not a packed model.*will not be "
                                              r"replaced.*choose another DEST") as e:
        pack(tiny_hf, dest, PackOptions(force=force, progress=False))
    assert "pass --force" not in str(e.value)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert "mine" in ((dest / "model.cst") if kind == "foreign model.cst" else
                      (dest / "keep") if kind == "directory" else dest).read_text()


def _copy_src(tiny_hf: Path, root: Path) -> Path:
    import shutil

    src = root / "models" / "src"
    shutil.copytree(tiny_hf, src)
    return src


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["src", "parent", "inside", "link to src", "link to parent",
                                   "inside a link"])
@pytest.mark.parametrize("force", [False, True])
def test_dest_overlapping_src_is_refused_before_anything_is_written(tiny_hf, tmp_path, where, force):
    src = _copy_src(tiny_hf, tmp_path)
    (tmp_path / "link-src").symlink_to(src)
    (tmp_path / "link-parent").symlink_to(src.parent)
    dest = {"src": src, "parent": src.parent, "inside": src / "new" / "p",
            "link to src": tmp_path / "link-src", "link to parent": tmp_path / "link-parent",
            "inside a link": tmp_path / "link-src" / "p"}[where]
    before = _tree(tmp_path / "models")
    with pytest.raises(ValueError, match=r"(is|lies inside|contains) SRC") as e:
        pack(src, dest, PackOptions(force=force, progress=False))
    assert str(dest) in str(e.value) and str(src) in str(e.value)
    assert "choose a DEST outside" in str(e.value)
    assert _tree(tmp_path / "models") == before  # not a byte changed, no folder made
    assert not (src / "new").exists()
    assert sorted(p.name for p in src.parent.iterdir()) == ["src"]


def test_cli_pack_src_onto_itself_or_its_parent_keeps_the_source(tiny_hf, tmp_path):
    src = _copy_src(tiny_hf, tmp_path)
    before = _tree(tmp_path / "models")
    for dest in (src, src.parent):
        r = subprocess.run([sys.executable, "-m", "deployments.cli", "pack", str(src), str(dest),
                            "--force", "-q"], cwd=Path(__file__).parents[1], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2 and "coldstart pack: error:" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert _tree(tmp_path / "models") == before


def test_side_files_are_complete_before_the_preamble_is_written(small_hf, tmp_path, monkeypatch):
    """The preamble (the magic) is model.cst's last write: by then every side file sits beside
    it, complete, so a file that opens never lacks its config or tokenizer."""
    from weights import packer

    seen: list[dict[str, bytes]] = []
    real = packer.encode_preamble

    def watch(data_bytes, index):
        tmp = next(d for d in tmp_path.iterdir() if d.name.startswith(".p.partial-"))
        seen.append({f.name: f.read_bytes() for f in tmp.iterdir() if f.name in packer.SIDE_FILES})
        return real(data_bytes, index)
    monkeypatch.setattr(packer, "encode_preamble", watch)
    pack(small_hf, tmp_path / "p", PackOptions(progress=False))
    want = {f.name: f.read_bytes() for f in small_hf.iterdir() if f.name in packer.SIDE_FILES}
    assert len(seen) == 1 and seen[0] == want and "tokenizer.json" in want


def _big_source(root: Path) -> Path:
    # ~400 MB in 8 shards: long enough to interrupt half-way
    shards = [{f"layer{i}.w": torch.full((12_500_000,), float(i))} for i in range(8)]
    return make_hf_dir(root, shards)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_pack_leaves_no_valid_dest(tmp_path, sig):
    src = _big_source(tmp_path / "src")
    dest = tmp_path / "out" / "p"
    code = ("import sys; from weights import pack, PackOptions; "
            f"pack({str(src)!r}, {str(dest)!r}, PackOptions(progress=False))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[1])
    deadline = time.time() + 60
    partial = None
    while time.time() < deadline and partial is None:
        found = list((tmp_path / "out").glob(".p.partial-*/" + WEIGHTS_FILE)) \
            if (tmp_path / "out").exists() else []
        if found and found[0].stat().st_size > 0:
            partial = found[0]
        time.sleep(0.005)
    assert partial is not None, "pack never started writing"
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not dest.exists()
    leftovers = list((tmp_path / "out").iterdir())
    if sig == signal.SIGINT:
        assert leftovers == []  # cleaned up on KeyboardInterrupt
    for d in leftovers:  # SIGKILL cannot be caught: what is left is not a valid packed file
        assert d.name.startswith(".p.partial-")
        with pytest.raises(Exception):
            read_packed(d)


def test_index_decides_which_files_are_the_model(tmp_path):
    # a repository that also ships the weights in another naming (consolidated.safetensors)
    src = make_hf_dir(tmp_path / "src", [{"a": torch.ones(3)}, {"b": torch.zeros(2)}])
    write_safetensors(src / "consolidated.safetensors", {"layers.0.wq": torch.ones(3)})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    m = load(pack(src, tmp_path / "p", PackOptions(progress=False)), "cpu")
    assert sorted(m.tensors) == ["a", "b"]


def test_index_naming_a_missing_shard(tmp_path):
    src = make_hf_dir(tmp_path / "src", [{"a": torch.ones(3)}])
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00001.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(SourceError, match=r"names model-00002-of-00002.safetensors, which is not in"):
        pack(src, tmp_path / "p")
