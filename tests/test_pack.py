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
from weights import PackedFormatError, PackOptions, SourceError, load, pack, read_packed, verify
from weights.format import ALIGN, WEIGHTS_FILE

ROOT = Path(__file__).resolve().parents[1]


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


def test_force_swaps_the_new_pack_in_without_a_moment_with_no_dest(tiny_hf, tmp_path, monkeypatch):
    """Where the system can swap two paths in one step, DEST is never renamed away: a replica
    starting while a pack replaces its model finds the old one or the new one, never none."""
    from weights import publish
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    if not publish.exchange(a, b):
        pytest.skip("this kernel, C library or filesystem cannot swap two paths in one step")
    assert (b / "x").read_text() == "a" and not (a / "x").exists()
    dest = pack(tiny_hf, tmp_path / "p", PackOptions(progress=False))
    renames: list[tuple[str, str]] = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda x, y: (renames.append((str(x), str(y))), real(x, y))[1])
    pack(tiny_hf, dest, PackOptions(chunk_bytes=8192, force=True, progress=False))
    assert not [r for r in renames if str(dest) in r], renames  # DEST was swapped, never renamed
    assert verify(dest).ok and read_packed(dest).index.chunk_bytes == 8192
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "p"]  # the old pack removed


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
        r = subprocess.run([sys.executable, "-m", "deployments.tools.cli", "pack", str(src), str(dest),
                            "--force", "-q"], cwd=ROOT, check=False, capture_output=True,
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


def _start_pack(src: Path, dest: Path, before: str = "", stderr=None) -> subprocess.Popen:
    """``pack(src, dest, force=True)`` in a process of its own, logging at INFO to stderr;
    ``before``: code run first in it (to stop it at a chosen point). Ctrl-C raises
    KeyboardInterrupt in it, as in a terminal, even where this process was started with SIGINT
    ignored (a background job of a shell), which its children inherit."""
    code = ("import logging, os, signal, sys, time; logging.basicConfig(level=logging.INFO); "
            "signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from weights import PackOptions, pack, packer; " + (before and before + "; ") +
            f"pack({str(src)!r}, {str(dest)!r}, PackOptions(force=True, progress=False))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=stderr)


def _wait_for(what: str, found) -> Path:
    deadline = time.time() + 120
    while time.time() < deadline:
        hit = found()
        if hit:
            return hit
        time.sleep(0.005)
    raise AssertionError(f"never saw {what}")


def _writing(parent: Path) -> Path | None:
    """The weights file a running pack into ``parent / "p"`` is writing, once it has bytes."""
    hits = list(parent.glob(".p.partial-*/model.cst.partial")) if parent.exists() else []
    return hits[0] if hits and hits[0].stat().st_size > 0 else None


def _assert_not_a_model(d: Path) -> None:
    """A pack's leftover: no model.cst, and every reader refuses it, saying what it is."""
    assert not (d / WEIGHTS_FILE).exists()
    for check in (read_packed, verify, lambda x: load(x, "cpu")):
        with pytest.raises(PackedFormatError, match="leftover of an interrupted `coldstart pack`"):
            check(d)
    r = subprocess.run([sys.executable, "-m", "deployments.tools.cli", "verify", str(d)], cwd=ROOT,
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "leftover of an interrupted" in r.stderr, r.stderr


def _pack_again_cleans_up(src: Path, out: Path, caplog, leftovers: list[Path]) -> None:
    with caplog.at_level("INFO", logger="weights"):
        pack(src, out / "p", PackOptions(force=True, progress=False))
    assert verify(out / "p").ok
    assert [p.name for p in out.iterdir()] == ["p"]  # leftovers and the lock file gone
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed ")]
    assert len(removed) == len(leftovers)
    for d, line in zip(sorted(leftovers), sorted(removed)):
        assert line.startswith(f"removed {d}, left by an interrupted pack into {out / 'p'} (")
        assert line.endswith(" MiB)")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_pack_leaves_no_model_and_the_next_pack_cleans_up(tmp_path, caplog, sig):
    src = _big_source(tmp_path / "src")
    out = tmp_path / "out"
    proc = _start_pack(src, out / "p")
    _wait_for("the pack writing", lambda: _writing(out))
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not (out / "p").exists()
    leftovers = [d for d in out.iterdir() if d.name.startswith(".p.partial-")]
    if sig == signal.SIGINT:
        assert list(out.iterdir()) == []  # cleaned up on KeyboardInterrupt, lock file too
    else:  # SIGKILL cannot be caught: its directory, named with its pid and host, and the lock file stay
        from weights.publish import HOST
        assert [d.name.split("-")[1] for d in leftovers] == [f"{proc.pid}.{HOST}"]
        assert sorted(p.name for p in out.iterdir()) == sorted([leftovers[0].name, ".p.lock"])
        _assert_not_a_model(leftovers[0])
    _pack_again_cleans_up(src, out, caplog, leftovers)


def test_a_pack_killed_after_its_header_leaves_nothing_that_verifies(tiny_hf, tmp_path, caplog):
    """Killed after the preamble (the magic) of the weights was written, before the last
    renames: the weights are complete but not named model.cst, and the directory is refused."""
    out = tmp_path / "out"
    kill = ("real = packer._pwrite_all; packer._pwrite_all = lambda fd, buf, off, f, name: "
            "(real(fd, buf, off, f, name), name == 'header' and os.kill(os.getpid(), signal.SIGKILL))")
    proc = _start_pack(tiny_hf, out / "p", kill)
    assert proc.wait(timeout=300) == -signal.SIGKILL
    (left,) = [d for d in out.iterdir() if d.name.startswith(".p.partial-")]
    assert (left / "model.cst.partial").read_bytes()[:8] == b"CLDSTRT\x00"  # it got that far
    assert (left / "tokenizer.json").read_bytes() == (tiny_hf / "tokenizer.json").read_bytes()
    _assert_not_a_model(left)
    r = subprocess.run([sys.executable, "-m", "deployments.tools.cli", "verify", str(out / "p")], cwd=ROOT,
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    _pack_again_cleans_up(tiny_hf, out, caplog, [left])


def test_two_packs_into_one_dest_run_one_after_the_other(tiny_hf, tmp_path):
    """The second pack waits for the first (it holds the lock, here until the test opens a
    gate), then replaces its result; neither removes the other's files."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    hold = ("real = packer._copy_side_files; packer._copy_side_files = lambda *a: "
            f"([time.sleep(0.01) for _ in iter(lambda: os.path.exists({str(gate)!r}), True)], "
            "real(*a))[1]")
    first = _start_pack(tiny_hf, out / "p", hold)
    _wait_for("the first pack's directory", lambda: list(out.glob(".p.partial-*")) if out.exists() else [])
    with open(tmp_path / "second.log", "w") as log:
        second = _start_pack(tiny_hf, out / "p", stderr=log)
        _wait_for("the second pack waiting", lambda: "waiting for it to finish" in
                  (tmp_path / "second.log").read_text())
    assert second.poll() is None and not (out / "p").exists()
    gate.touch()
    assert first.wait(timeout=300) == 0 and second.wait(timeout=300) == 0
    assert verify(out / "p").ok
    assert [p.name for p in out.iterdir()] == ["p"]
    assert "removed" not in (tmp_path / "second.log").read_text()


def test_leftovers_of_running_packs_and_of_other_dests_are_kept(tiny_hf, tmp_path, caplog):
    """What a pack into DEST removes: leftovers of packs into DEST on this host whose process is
    gone, and those named without a pid (by an older coldstart); nothing of a live process, nothing
    another host's pack left (its pid means nothing here), nothing else."""
    from weights.publish import HOST

    other = "deadbeef" if HOST != "deadbeef" else "0badcafe"
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True).stdout.strip()
    alive = subprocess.Popen(["sleep", "600"])
    try:
        gone = [f".p.partial-{dead}-abcd_123", ".p.partial-x7k2q9zz", f".p.old-{dead}",
                f".p.old-{dead}-0123abcd", f".p.partial-{dead}.{HOST}-abcd_123", f".p.old-{dead}.{HOST}-0123abcd"]
        kept = [f".p.partial-{alive.pid}-abcd_123", f".q.partial-{dead}-abcd_123", "p.partial-notes",
                f".p.partial-{dead}-abcd_123.bak", f".p.partial-{alive.pid}.{HOST}-abcd_123",
                f".p.partial-{dead}.{other}-abcd_123", f".p.old-{dead}.{other}-0123abcd"]
        for name in gone + kept:
            (out / name).mkdir()
            (out / name / "model.cst.partial").write_bytes(os.urandom(1 << 20))
        with caplog.at_level("INFO", logger="weights"):
            pack(tiny_hf, out / "p", PackOptions(progress=False))
        assert sorted(p.name for p in out.iterdir()) == sorted(kept + ["p"])
        lines = [r.getMessage() for r in caplog.records]
        for name in gone:
            assert any(m.startswith(f"removed {out / name}, left by an interrupted pack into "
                                    f"{out / 'p'} (1.0 MiB)") for m in lines), (name, lines)
        assert any(m.startswith(f"kept {out / kept[0]}: the pack that left it (pid {alive.pid})")
                   for m in lines)
        assert any(m.startswith(f"kept {out / kept[5]}: left by a pack on another host (pid {dead} there)")
                   for m in lines)
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("name", [".m.partial-4242.0123abcd-abcd_123", ".m.partial-4242-abcd_123",
                                  ".m.partial-abcd_123"])
def test_a_complete_pack_left_under_its_temporary_name_is_refused(tiny_packed, tmp_path, name):
    """Killed between the weights' rename and the directory's: complete, yet not published (the
    names of this coldstart and of older ones)."""
    import shutil

    left = tmp_path / name
    shutil.copytree(tiny_packed, left)
    with pytest.raises(PackedFormatError, match=rf"leftover of an interrupted `coldstart pack` into "
                                                rf"{tmp_path / 'm'}, not a packed model"):
        read_packed(left / "model.cst")
    shutil.copytree(left, tmp_path / "m")  # renamed by hand: a model like any other
    assert verify(tmp_path / "m").ok


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
