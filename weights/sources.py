"""Reading tensors out of a Hugging Face checkpoint directory, one at a time.

Two formats: safetensors shards (parsed here directly: an 8-byte header length,
a JSON header, then raw bytes; memory-mapped, so a tensor costs no RAM until it
is touched) and PyTorch ``.bin`` files, read with ``torch.load(weights_only=True,
mmap=True)``, which never unpickles code. Every source yields the same thing:
``(name, tensor, file)`` in a stable order. Also what a pack checks of SRC first:
that it is a checkpoint whose side files read (``check_source``), and that DEST
neither is nor holds nor lies inside it (``check_apart``).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .format import SIDE_FILES, read_json, read_tokenizer
from .publish import file_id, is_within

# safetensors dtype codes -> torch dtypes we store
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ELEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
         "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 << 20


class SourceError(ValueError):
    """The source checkpoint cannot be packed; the message names the file and tensor."""


@dataclass(frozen=True)
class SourceTensor:
    name: str
    file: Path
    dtype: str          # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]


def find_weight_files(src: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else every safetensors
    file, else every ``.bin`` file.

    The index matters: some repositories ship the same weights twice (sharded
    ``model-*.safetensors`` plus a ``consolidated.safetensors`` in another
    naming), and only the index says which set the model uses.
    """
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "*.bin")):
        index = src / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise SourceError(f"{index}: not a valid weight index ({e}); fix or remove it") from e
            missing = [n for n in names if not (src / n).is_file()]
            if missing:
                raise SourceError(f"{index} names {', '.join(missing)}, which "
                                  f"{'is' if len(missing) == 1 else 'are'} not in {src}; "
                                  "the download is incomplete")
            return [src / n for n in names]
    st = sorted(src.glob("*.safetensors"))
    if st:
        return st
    return sorted(p for p in src.glob("*.bin") if p.name != "training_args.bin")


# what to do about a damaged shard
_REFETCH = "download the shard again from the model's source"


def _is_count(v: object) -> bool:
    return type(v) is int and v >= 0


class SafetensorsFile:
    """One safetensors shard, checked as the safetensors library checks one before a byte of
    it is used: the header's length lies within the file, the header is a JSON object, every
    tensor's byte length is its shape times its dtype's size, and the tensors' data_offsets,
    sorted, cover the data region exactly (from 0, no gap, no overlap, up to the file's end).

    The last check is what catches a header-length field lowered by a flipped bit: the JSON
    still parses (its trailing padding is whitespace) while every tensor would be read from
    bytes shifted by as much."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        hlen, header = _read_header(path, size)
        self.base = 8 + hlen
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            hi = (entry := _entry(path, name, e))[3]
            self.entries[name] = entry
            if self.base + hi > size:
                raise SourceError(
                    f"{path}: truncated: tensor {name!r} ends at byte {self.base + hi}, "
                    f"the file has {size}; re-download the shard")
        _check_coverage(path, self.entries, hlen, size)
        self._mm: mmap.mmap | None = None

    def names(self) -> list[str]:
        return list(self.entries)

    def describe(self, name: str) -> SourceTensor:
        code, shape, _, _ = self.entries[name]
        return SourceTensor(name, self.path, str(_ST_DTYPES[code]).removeprefix("torch."), shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as a CPU view of the memory-mapped file (no copy)."""
        code, shape, lo, hi = self.entries[name]
        if self._mm is None:
            with open(self.path, "rb") as f:
                # a private (copy-on-write) map: writable for torch, never written
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        dtype = _ST_DTYPES[code]
        if hi == lo:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(np.frombuffer(self._mm, dtype=np.uint8, count=hi - lo,
                                             offset=self.base + lo))
        if (self.base + lo) % _ELEM[code]:
            raw = raw.clone()  # misaligned in the source: view(dtype) needs an aligned start
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a tensor still views it (an error's traceback holds one): unmapped with the last view
            self._mm = None


def _read_header(path: Path, size: int) -> tuple[int, dict]:
    """The header's length field and its JSON object, without ``__metadata__``."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceError(f"{path}: truncated safetensors file ({size} bytes, no header); {_REFETCH}")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > _MAX_HEADER:
            raise SourceError(f"{path}: corrupt safetensors file: its header-length field says {hlen} bytes, "
                              f"more than the {_MAX_HEADER} a header may have; {_REFETCH}")
        if 8 + hlen > size:
            raise SourceError(f"{path}: truncated or corrupt safetensors file: its header-length field says "
                              f"{hlen} bytes, the file has {size - 8} after the field; {_REFETCH}")
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except ValueError as e:  # (UnicodeDecodeError too)
        raise SourceError(f"{path}: safetensors header is not valid JSON ({e}); {_REFETCH}") from e
    if not isinstance(header, dict):
        raise SourceError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object of "
                          f"tensors; {_REFETCH}")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise SourceError(f"{path}: safetensors header's __metadata__ is not a map of strings to strings; "
                          f"{_REFETCH}")
    return hlen, header


def _entry(path: Path, name: str, e: object) -> tuple[str, tuple[int, ...], int, int]:
    """A header entry as (dtype code, shape, start, end), each field checked."""
    if not isinstance(e, dict):
        raise SourceError(f"{path}: tensor {name!r}: its header entry is not an object; {_REFETCH}")
    code, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise SourceError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of non-negative "
                          f"integers; {_REFETCH}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(v) for v in offsets)
            and offsets[0] <= offsets[1]):
        raise SourceError(f"{path}: tensor {name!r}: data_offsets {offsets!r} is not [start, end] with "
                          f"0 <= start <= end; {_REFETCH}")
    if code not in _ST_DTYPES:
        raise SourceError(
            f"{path}: tensor {name!r} has dtype {code}, which a packed file cannot hold; "
            f"supported: {', '.join(_ST_DTYPES)}. Convert it first or drop it.")
    lo, hi = offsets
    n = int(np.prod(shape, dtype=np.int64)) * _ELEM[code]
    if hi - lo != n:
        raise SourceError(f"{path}: tensor {name!r} has {hi - lo} bytes for shape "
                          f"{shape} of {code} ({n} expected); the file is corrupt: {_REFETCH}")
    return code, tuple(shape), lo, hi


def _check_coverage(path: Path, entries: dict[str, tuple[str, tuple[int, ...], int, int]], hlen: int,
                    size: int) -> None:
    """The tensors, sorted by offset, cover the data region exactly: from its byte 0, each
    starting where the one before ends, the last ending at the file's end."""
    end, before = 0, None
    for name, (_, _, lo, hi) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if lo != end:
            where = (f"the data region's bytes {end}..{lo} belong to no tensor" if lo > end else
                     f"it overlaps tensor {before!r} by {end - lo} bytes")
            raise SourceError(f"{path}: tensor {name!r} starts at data byte {lo}, but "
                              f"{f'tensor {before!r} ends at {end}' if before else 'the data region starts at 0'}"
                              f" ({where}); the header's data_offsets must cover the data exactly; {_REFETCH}")
        end, before = hi, name
    if 8 + hlen + end != size:
        raise SourceError(
            f"{path}: the file is not fully covered by its tensors: with the header-length field's {hlen} "
            f"bytes the tensors' data would end at byte {8 + hlen + end}, the file has {size}; a damaged "
            f"header-length field or data_offsets would have every tensor read from the wrong bytes; {_REFETCH}")


def _bin_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for a bad or unsafe pickle
        raise SourceError(f"{path}: cannot read it as a PyTorch weights file with "
                          f"weights_only=True ({type(e).__name__}: {e})") from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise SourceError(f"{path}: not a flat state dict of tensors")
    return sd


def open_sources(files: list[Path]) -> tuple[dict[str, SourceTensor], list, dict[str, str]]:
    """Index every tensor of every file, refusing duplicate names across shards.

    Returns the tensors' descriptions, one handle per file, and the aliases:
    tensors of a ``.bin`` file that share storage with an earlier one (tied
    embeddings), as ``{alias: name stored}``.
    """
    where: dict[str, SourceTensor] = {}
    handles: list = []
    aliases: dict[str, str] = {}
    for path in files:
        if path.suffix == ".safetensors":
            h = SafetensorsFile(path)
            metas = [h.describe(n) for n in h.names()]
        else:
            h = _bin_state(path)
            metas = []
            seen: dict[tuple, str] = {}
            for n, t in h.items():
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                       tuple(t.stride()), t.dtype)
                if t.numel() and key in seen:
                    aliases[n] = seen[key]
                    continue
                seen[key] = n
                metas.append(SourceTensor(n, path, str(t.dtype).removeprefix("torch."),
                                          tuple(t.shape)))
        handles.append(h)
        for m in metas:
            if m.name in where:
                raise SourceError(f"tensor {m.name!r} is in both {where[m.name].file.name} and "
                                  f"{path.name}; a checkpoint must name each tensor once")
            where[m.name] = m
    return where, handles, aliases


def iter_tensors(files: list[Path], handles: list,
                 skip: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Every tensor, file by file in the files' own order (sequential reads)."""
    for path, h in zip(files, handles):
        items = ((n, h.get(n)) for n in h.names()) if isinstance(h, SafetensorsFile) else h.items()
        for name, t in items:
            if name not in skip:
                yield name, t, path


def check_source(src: Path) -> list[Path]:
    """SRC's weight files, after checking that SRC is a checkpoint directory whose side files a
    replica could read (SourceError naming what is wrong otherwise)."""
    if not src.exists():
        raise SourceError(f"{src}: no such directory; give the path of a Hugging Face model directory")
    if not src.is_dir():
        raise SourceError(f"{src}: not a directory; give the path of a Hugging Face model directory")
    if not any(src.iterdir()):
        raise SourceError(f"{src}: the directory is empty; download or copy the model into it first")
    if not (src / "config.json").is_file():
        raise SourceError(f"{src}: no config.json; a Hugging Face model directory has one "
                          "(save the model with save_pretrained, or copy config.json in)")
    files = find_weight_files(src)
    if not files:
        raise SourceError(f"{src}: no weights (*.safetensors or *.bin files) found")
    _check_side_files(src)
    return files


def _check_side_files(src: Path) -> None:
    """The side files a replica reads must read: refused here, not when a replica starts."""
    fix = "copy it again from the model's source"
    for name in SIDE_FILES:
        p = src / name
        # (tokenizer.json: read whole by the tokenizers library below, not parsed twice)
        if not name.endswith(".json") or name == "tokenizer.json" or not p.is_file():
            continue
        try:
            read_json(p, fix)
        except ValueError as e:
            raise SourceError(str(e)) from None
    if (src / "tokenizer.json").is_file():
        try:
            read_tokenizer(src / "tokenizer.json", fix)
        except ValueError as e:
            raise SourceError(str(e)) from None


def check_apart(src: Path, dest: Path) -> None:
    """Refuse a DEST that is SRC, lies inside it or contains it: writing or replacing it would
    change or delete the source. Compared by resolved path and by (device, inode) of the
    directories on the way up, so symlinks and bind mounts are seen through."""
    rs, rd = src.resolve(), dest.resolve()
    fix = f"choose a DEST outside {src}"
    if rd == rs or is_within(rd, rs):
        how = "is" if rd == rs or (rd.exists() and file_id(rd) == file_id(rs)) else "lies inside"
        raise ValueError(f"DEST {dest} {how} SRC {src}: packing there would overwrite the "
                         f"source checkpoint; {fix}")
    if rd.exists() and is_within(rs, rd):
        raise ValueError(f"DEST {dest} contains SRC {src}: replacing it would delete the source "
                         f"checkpoint; {fix}")
