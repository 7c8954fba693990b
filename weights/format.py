"""The packed weight format: one flat file a loader pours into ONE device buffer.

A packed model is a directory::

    <name>/
      model.cst                 the weights (this format)
      config.json               copied from the Hugging Face checkpoint
      generation_config.json    (if the source had one)
      tokenizer.json, tokenizer_config.json, special_tokens_map.json, ...

A pack writes it as a temporary ``.<name>.partial-*`` directory beside it and
renames that to ``<name>`` when complete (``weights.packer``); ``read_packed``
refuses such a temporary directory.

``model.cst`` layout (all integers little-endian)::

    offset 0        preamble, PREAMBLE_BYTES (4096) bytes:
                      0  magic          8 bytes  b"CLDSTRT\\x00"
                      8  version        u32      FORMAT_VERSION
                     12  flags          u32      0 (reserved)
                     16  data_offset    u64      = 4096: start of the data region
                     24  data_bytes     u64      length of the data region, a multiple of ALIGN
                     32  index_offset   u64      = data_offset + data_bytes
                     40  index_bytes    u64      length of the JSON index
                     48  index_sha256   32 bytes sha256 of the index bytes
                     80  zeros up to byte 4092
                   4092  preamble_crc32 u32      crc32 of bytes 0..4092
    data_offset     data region: every tensor's bytes, each tensor starting at a
                    multiple of ALIGN (4096) from the region's start, zero padding
                    between them; the region's length is a multiple of ALIGN.
    index_offset    the index: UTF-8 JSON (see ``Index``), then end of file.

Because every tensor is aligned inside one region, the whole region maps onto one
device allocation and every tensor is a view of it (``torch.Tensor.view(dtype)``
needs the element offset aligned; 4 KiB also matches pages and O_DIRECT).

Integrity. The data region is cut into chunks of ``chunk_bytes`` (a multiple of
4096, recorded in the index; the last chunk may be shorter). Each chunk's two
64-bit sums are stored in the index (``weights.checksum``: a position-weighted
Fletcher-style sum over 64-bit words, computed by two reductions, so a GPU
checks 13 GB in milliseconds and a CPU at memory speed). They catch flipped
bits, truncation, and shifted or swapped blocks. They are not cryptographic.
The index carries the chunk sums and is covered by ``index_sha256``; the
preamble, which holds that hash, is covered by its crc32. The sha256 of the
index is therefore a digest of the whole file (``PackedFile.digest``).

Side files. The index's ``side_files`` maps the name of every side file the pack
copied (``SIDE_FILES``: config, generation config, tokenizer files, chat template)
to its sha256 and size::

    "side_files": {"config.json": {"sha256": "<64 hex digits>", "bytes": 516},
                   "tokenizer.json": {"sha256": "...", "bytes": 21873}, ...}

They change what a replica serves as much as the weights do (rope_theta, the eos
ids, the tokens, the chat template), so a load checks every listed file up front
and refuses a missing or changed one, or a side file the index does not list;
``coldstart verify`` reports each. Being in the index, they are also part of
``PackedFile.digest``. The packer writes them before ``model.cst``'s preamble. A
file packed before this key existed has none: it loads and verifies, with a note
that its side files are unprotected until it is re-packed. Readers ignore index
keys they do not know, so older coldstart reads files that have it (the version
stays 1).

Tensor-parallel (split) packs. ``coldstart pack SRC DEST --tp N`` writes one file of this format
per rank, each holding that rank's slice of every tensor (the rules: ``weights.tp``)::

    DEST/
      tp.json                 the split: N, each rank's directory, the layout, the pack's id
      config.json, ...        the side files, once, for every rank
      rank-0/model.cst ... rank-<N-1>/model.cst

A rank's file is complete in itself (alignment, chunk sums, index); its index's
``metadata["tp"]`` is ``{"size": N, "rank": K}``, its side files are DEST's (the directory above
its own), and its ``side_files`` list ``tp.json`` with them, so a changed manifest, or a rank file
from another pack, is refused like a changed tokenizer. DEST has no ``model.cst``:
``read_packed(DEST)`` raises ``TensorParallelPackError`` saying how to load one rank;
``read_packed(DEST/rank-K)`` reads rank K's file and refuses one that records another rank.

The format is little-endian only; ``open_packed`` refuses a big-endian host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MAGIC = b"CLDSTRT\x00"
FORMAT_VERSION = 1
PREAMBLE_BYTES = 4096
ALIGN = 4096
DEFAULT_CHUNK_BYTES = 16 << 20
WEIGHTS_FILE = "model.cst"
CHECKSUM_NAME = "wfletcher64-512"

TP_MANIFEST = "tp.json"  # a split pack's manifest (see the docstring)
_RANK_DIR = re.compile(r"rank-\d+")


def rank_dir(rank: int) -> str:
    """The directory of rank ``rank``'s weights in a split pack."""
    return f"rank-{rank}"


# Files that travel with the weights so the packed directory alone serves the model.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
)

# struct layout of the preamble's fields (see the module docstring)
_PREAMBLE = struct.Struct("<8sIIQQQQ32s")
_CRC_AT = PREAMBLE_BYTES - 4

# dtype name in the index -> (element size, torch dtype attribute name)
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "float64"),
    "float32": (4, "float32"),
    "float16": (2, "float16"),
    "bfloat16": (2, "bfloat16"),
    "float8_e4m3fn": (1, "float8_e4m3fn"),
    "float8_e5m2": (1, "float8_e5m2"),
    "int64": (8, "int64"),
    "int32": (4, "int32"),
    "int16": (2, "int16"),
    "int8": (1, "int8"),
    "uint8": (1, "uint8"),
    "bool": (1, "bool"),
}


class PackedFormatError(Exception):
    """A packed file is malformed, truncated, corrupt or of an unknown version.

    The message names the file and, where it applies, the tensor or chunk.
    """


class TensorParallelPackError(PackedFormatError):
    """A tensor-parallel (split) pack was given where one packed model was expected: the message
    says how to load one rank's part."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the index; ``offset`` is relative to the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SideFile:
    """A side file's entry in the index: its content's sha256 (hex) and size."""

    sha256: str
    bytes: int


@dataclass
class Index:
    """The JSON index at the end of ``model.cst``. ``side_files`` is None for a file packed
    before side files were recorded (nothing to check them against)."""

    tensors: list[TensorEntry]
    chunk_bytes: int
    chunk_sums: list[tuple[int, int]]
    aliases: dict[str, str] = field(default_factory=dict)  # name -> name it shares storage with
    metadata: dict[str, Any] = field(default_factory=dict)
    side_files: dict[str, SideFile] | None = None

    def to_bytes(self) -> bytes:
        doc = {
            "format": "coldstart",
            "version": FORMAT_VERSION,
            "alignment": ALIGN,
            "checksum": CHECKSUM_NAME,
            "chunk_bytes": self.chunk_bytes,
            # sums as fixed-width hex: JSON numbers above 2**53 lose bits in many readers
            "chunk_sums": [f"{a:016x}{b:016x}" for a, b in self.chunk_sums],
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                 "offset": t.offset, "nbytes": t.nbytes}
                for t in self.tensors
            ],
            "aliases": self.aliases,
            "metadata": self.metadata,
        }
        if self.side_files is not None:
            doc["side_files"] = {n: {"sha256": f.sha256, "bytes": f.bytes}
                                 for n, f in sorted(self.side_files.items())}
        return json.dumps(doc, separators=(",", ":")).encode()


def encode_preamble(data_bytes: int, index: bytes) -> bytes:
    head = _PREAMBLE.pack(
        MAGIC, FORMAT_VERSION, 0, PREAMBLE_BYTES, data_bytes,
        PREAMBLE_BYTES + data_bytes, len(index), hashlib.sha256(index).digest(),
    )
    buf = bytearray(PREAMBLE_BYTES)
    buf[: len(head)] = head
    struct.pack_into("<I", buf, _CRC_AT, zlib.crc32(bytes(buf[:_CRC_AT])))
    return bytes(buf)


@dataclass
class PackedFile:
    """An opened (not yet loaded) packed weight file: preamble and index only."""

    path: Path
    file_bytes: int
    data_offset: int
    data_bytes: int
    index: Index
    digest: str

    @property
    def tensors(self) -> list[TensorEntry]:
        return self.index.tensors

    @property
    def tp(self) -> dict | None:
        """``{"size": N, "rank": K}`` for a rank's file of a split pack, else None."""
        return self.index.metadata.get("tp")

    @property
    def model_dir(self) -> Path:
        """The packed model's directory, where its side files are: the file's own, or for a rank's
        file of a split pack the one above it."""
        return self.path.parent.parent if self.tp else self.path.parent

    def tensors_in_chunk(self, chunk: int) -> list[str]:
        """Names of the tensors whose bytes overlap chunk number ``chunk``."""
        lo = chunk * self.index.chunk_bytes
        hi = lo + self.index.chunk_bytes
        return [t.name for t in self.index.tensors if t.offset < hi and t.offset + t.nbytes > lo]

    def describe_chunk(self, chunk: int) -> str:
        names = self.tensors_in_chunk(chunk)
        lo = self.data_offset + chunk * self.index.chunk_bytes
        hi = min(lo + self.index.chunk_bytes, self.data_offset + self.data_bytes)
        what = ", ".join(repr(n) for n in names[:4]) or "padding only"
        if len(names) > 4:
            what += f" and {len(names) - 4} more"
        return f"chunk {chunk} (file bytes {lo}..{hi}, tensors {what})"


def read_json(path: Path, then: str) -> dict:
    """A JSON side file (config.json, tokenizer_config.json, ...: each one JSON object);
    ValueError naming the file, where its JSON breaks and ``then`` (what to do) if it is not
    JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not valid JSON ({e}); {then}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: holds a JSON {type(doc).__name__}, not an object; {then}")
    return doc


def read_tokenizer(path: Path, then: str) -> Tokenizer:
    """tokenizer.json as a ``tokenizers.Tokenizer``; ValueError naming the file, the library's
    reason and ``then`` if the library cannot read it."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own error type; its message says where the file breaks
        raise ValueError(f"{path}: the tokenizers library cannot read it ({e}); {then}") from None


def _fail(path: Path, msg: str) -> PackedFormatError:
    return PackedFormatError(f"{path}: {msg}")


def read_packed(path: str | os.PathLike) -> PackedFile:
    """Read and check the preamble and index of a packed weight file.

    Reads 4 KiB plus the index, never the data region. Every structural problem
    (wrong magic, newer version, truncation, a flipped byte in preamble or index,
    an index entry outside the data region) raises ``PackedFormatError``.

    Args:
        path: ``model.cst`` itself or a packed model directory holding it.
    Returns:
        A ``PackedFile``.
    """
    if sys.byteorder != "little":
        raise PackedFormatError("packed weight files are little-endian; this host is big-endian")
    p = Path(path)
    if p.is_dir() or (p.name != WEIGHTS_FILE and not p.exists()):  # a packed directory, made or not
        p = p / WEIGHTS_FILE
    refuse_leftover(p.parent)
    if not p.exists():
        if (p.parent / TP_MANIFEST).is_file() or (p.parent.parent / TP_MANIFEST).is_file():
            raise split_pack_error(p.parent)
        raise FileNotFoundError(f"{p}: no packed weight file ({p.name} missing); make one with "
                                f"`coldstart pack HF_DIR {p.parent}`")
    size = p.stat().st_size
    with open(p, "rb") as f:
        def read(off: int, n: int) -> bytes:
            f.seek(off)
            return f.read(n)
        return parse_packed(p, size, read)


def parse_packed(p: Path, size: int, read: "Callable[[int, int], bytes]", where: str | None = None) -> PackedFile:
    """The checks of ``read_packed`` over a file of ``size`` bytes read through ``read(offset,
    length)`` (a local file, or a remote one by ranged reads); ``p`` is the path the returned
    ``PackedFile`` names, ``where`` what messages name (default ``p``)."""
    shown = Path(where) if where is not None else p
    pre = read(0, PREAMBLE_BYTES)
    if len(pre) < _PREAMBLE.size or pre[:8] != MAGIC:
        raise _fail(shown, f"not a coldstart packed file (magic {pre[:8]!r}, expected {MAGIC!r}); "
                           "re-create it with `coldstart pack`")
    _magic, version, _flags, data_off, data_bytes, index_off, index_bytes, index_sha = \
        _PREAMBLE.unpack_from(pre)
    if len(pre) == PREAMBLE_BYTES and version <= FORMAT_VERSION:
        want_crc = struct.unpack_from("<I", pre, _CRC_AT)[0]
        if zlib.crc32(pre[:_CRC_AT]) != want_crc:
            raise _fail(shown, "header is corrupt (preamble crc32 mismatch); re-pack or re-copy the file")
    if version > FORMAT_VERSION:
        raise _fail(shown, f"format version {version} is newer than this coldstart reads "
                           f"(up to {FORMAT_VERSION}); upgrade coldstart")
    if version < 1:
        raise _fail(shown, f"format version {version} is invalid; re-pack the model")
    if len(pre) < PREAMBLE_BYTES:
        raise _fail(shown, f"truncated: {size} bytes, shorter than the {PREAMBLE_BYTES}-byte header")
    if data_off != PREAMBLE_BYTES or data_bytes % ALIGN or index_off != data_off + data_bytes:
        raise _fail(shown, "header is inconsistent (data region offsets); re-pack the model")
    expected = index_off + index_bytes
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise _fail(shown, f"{kind}: file is {size} bytes, header says {expected}; "
                           "re-copy or re-pack the model")
    raw = read(index_off, index_bytes)
    if hashlib.sha256(raw).digest() != index_sha:
        raise _fail(shown, "index is corrupt (sha256 mismatch); re-pack or re-copy the file")
    index = _parse_index(shown, raw, data_bytes)
    if "tp" in index.metadata:
        check_rank(p, index.metadata["tp"])
    return PackedFile(p, size, data_off, data_bytes, index, index_sha.hex())


# ----------------------------------------------------------------------------- a split pack's manifest and ranks
# (read here, where read_packed needs them; the slicing rules and the manifest's writer: weights.tp)

MANIFEST_FORMAT = "coldstart-tp"


def read_manifest(dest: str | os.PathLike) -> dict:
    """``DEST/tp.json``, checked: PackedFormatError naming the file when it is not a split pack's
    manifest."""
    path = Path(dest) / TP_MANIFEST
    fix = "re-pack the model with `coldstart pack SRC DEST --tp N`"
    try:
        doc = read_json(path, fix)
    except ValueError as e:
        raise PackedFormatError(str(e)) from None
    size = doc.get("size")
    if doc.get("format") != MANIFEST_FORMAT or not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise PackedFormatError(f"{path}: not a split pack's manifest (format {doc.get('format')!r}, size "
                                f"{size!r}); {fix}")
    return doc


def split_pack_error(d: Path) -> PackedFormatError | FileNotFoundError:
    """The error for a split pack given where one packed model was expected (or one of its rank
    directories without its file): what to do instead."""
    if (d.parent / TP_MANIFEST).is_file():
        return FileNotFoundError(f"{d / WEIGHTS_FILE}: missing from the split pack {d.parent}; copy the pack again "
                                 f"as it was packed, or re-pack it (`coldstart pack SRC {d.parent} --tp N`)")
    try:
        size = read_manifest(d)["size"]
    except PackedFormatError as e:
        return e
    return TensorParallelPackError(
        f"{d}: a tensor-parallel pack split over {size} ranks ({TP_MANIFEST}, {rank_dir(0)}/ to "
        f"{rank_dir(size - 1)}/), not one model: load rank K's part with weights.load({str(d)!r}, rank=K) "
        f"(or {d / rank_dir(0)}, ...) and build it with build_model(config, tensors, tp=process_group) in "
        f"each of {size} processes; `coldstart verify {d}` checks every rank; to serve it on one device, "
        "pack the source again without --tp")


def check_rank(p: Path, tp: object) -> None:
    """A rank's file ``p`` of a split pack (its index's ``metadata["tp"]``: ``tp``) records a rank,
    and lies in that rank's directory; PackedFormatError naming the file otherwise."""
    size, rank = (tp.get("size"), tp.get("rank")) if isinstance(tp, dict) else (None, None)
    if not (type(size) is int and type(rank) is int and 0 <= rank < size):
        raise PackedFormatError(f"{p}: index metadata tp={tp!r} is not a rank of a split pack; re-pack the model")
    if p.parent.name != rank_dir(rank):
        raise PackedFormatError(f"{p}: holds the weights of rank {rank} of {size} but lies in {p.parent.name}/, "
                                f"not {rank_dir(rank)}/; copy the split pack again as it was packed")


# a pack's temporary directory (weights.publish): ".NAME.partial-PID.HOST-XXXXXXXX"; older packs'
# have no HOST, or no PID
_PARTIAL_DIR = re.compile(r"\.(.+)\.partial-(?:\d+(?:\.[0-9a-f]{8})?-)?[a-z0-9_]{8}")


def refuse_leftover(d: Path) -> None:
    """A pack's temporary directory is never a model, even one whose pack got as far as its
    last rename: refused by name, saying what it is (for a rank's directory, by its parent's)."""
    r = d.resolve()
    for x in ((r, r.parent) if _RANK_DIR.fullmatch(r.name) else (r,)):
        m = _PARTIAL_DIR.fullmatch(x.name)
        if m:
            dest = x.parent / m.group(1)
            raise _fail(d, f"the leftover of an interrupted `coldstart pack` into {dest}, not a packed "
                           f"model; pack again (the next pack into {dest} removes it) or delete it")


def _parse_index(p: Path, raw: bytes, data_bytes: int) -> Index:
    try:
        doc = json.loads(raw)
        chunk_bytes = int(doc["chunk_bytes"])
        if doc.get("checksum") != CHECKSUM_NAME:
            raise _fail(p, f"unknown checksum {doc.get('checksum')!r}; upgrade coldstart")
        sums = [(int(s[:16], 16), int(s[16:], 16)) for s in doc["chunk_sums"]]
        entries = [
            TensorEntry(t["name"], t["dtype"], tuple(int(d) for d in t["shape"]),
                        int(t["offset"]), int(t["nbytes"]))
            for t in doc["tensors"]
        ]
        aliases = dict(doc.get("aliases", {}))
        meta = dict(doc.get("metadata", {}))
        side = _parse_side_files(p, doc["side_files"]) if "side_files" in doc else None
    except PackedFormatError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise _fail(p, f"index is malformed ({type(e).__name__}: {e}); re-pack the model") from e
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise _fail(p, f"index chunk_bytes={chunk_bytes} is not a positive multiple of {ALIGN}")
    n_chunks = -(-data_bytes // chunk_bytes)
    if len(sums) != n_chunks:
        raise _fail(p, f"index has {len(sums)} chunk checksums, the data region needs {n_chunks}")
    names = set()
    for t in entries:
        if t.dtype not in DTYPES:
            raise _fail(p, f"tensor {t.name!r} has unknown dtype {t.dtype!r}; upgrade coldstart")
        if t.name in names:
            raise _fail(p, f"tensor {t.name!r} appears twice in the index")
        names.add(t.name)
        if t.offset % ALIGN or t.offset < 0:
            raise _fail(p, f"tensor {t.name!r} offset {t.offset} is not {ALIGN}-aligned")
        if t.nbytes != t.numel * DTYPES[t.dtype][0]:
            raise _fail(p, f"tensor {t.name!r}: {t.nbytes} bytes do not match shape "
                           f"{list(t.shape)} of {t.dtype}")
        if t.offset + t.nbytes > data_bytes:
            raise _fail(p, f"tensor {t.name!r} spans data bytes {t.offset}..{t.offset + t.nbytes}, "
                           f"outside the {data_bytes}-byte data region; re-pack the model")
    for a, target in aliases.items():
        if target not in names or a in names:
            raise _fail(p, f"alias {a!r} -> {target!r} does not name a stored tensor")
    return Index(entries, chunk_bytes, sums, aliases, meta, side)


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _parse_side_files(p: Path, raw: Any) -> dict[str, SideFile]:
    """The index's ``side_files``: plain file names (nothing that leads out of the directory),
    each with a 64-digit hex sha256 and a size."""
    if not isinstance(raw, dict):
        raise _fail(p, f"index side_files is a {type(raw).__name__}, not an object; re-pack the model")
    out = {}
    for name, e in raw.items():
        ok = (isinstance(e, dict) and isinstance(e.get("sha256"), str)
              and _SHA256_HEX.fullmatch(e["sha256"]) and type(e.get("bytes")) is int and e["bytes"] >= 0)
        if not ok or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise _fail(p, f"index side_files entry {name!r}: {e!r} is not a file name with "
                           "a sha256 and a size; re-pack the model")
        out[name] = SideFile(e["sha256"], e["bytes"])
    return out


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


_FIX_SIDE = "re-copy the packed model from where it was packed, or re-pack it"


def side_file_problems(packed: PackedFile) -> list[str]:
    """What is wrong with the side files beside ``packed``, one line per file naming it and
    the fix: a listed one missing or changed, or one of ``SIDE_FILES`` the index does not
    list (a replica would read it unchecked). Empty when all match, or when the file
    predates side-file checksums (see ``unprotected_note``)."""
    listed = packed.index.side_files
    if listed is None:
        return []
    d = packed.model_dir
    out = [m for name, want in sorted(listed.items()) if (m := _side_file_problem(d / name, want))]
    out += [f"{d / name}: not part of the packed model (model.cst's index does not list it), yet "
            "a replica would read it; remove it, or re-pack from a source that has it"
            for name in SIDE_FILES if name not in listed and os.path.lexists(d / name)]
    return out


def _side_file_problem(path: Path, want: SideFile) -> str | None:
    try:
        if not path.is_file():
            what = "missing" if not os.path.lexists(path) else "not a regular file"
            return f"{path}: {what} (model.cst's index lists it, {want.bytes} bytes); {_FIX_SIDE}"
        size = path.stat().st_size
        if size != want.bytes:
            return (f"{path}: changed since packing ({size} bytes, the index says {want.bytes}); "
                    f"{_FIX_SIDE}")
        got = file_sha256(path)
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e}); {_FIX_SIDE}"
    if got != want.sha256:
        return (f"{path}: changed since packing (sha256 {got[:16]}..., the index says "
                f"{want.sha256[:16]}...); {_FIX_SIDE}")
    return None


def check_side_files(packed: PackedFile) -> str | None:
    """Raise ``PackedFormatError`` naming every side file that does not match the index (see
    ``side_file_problems``); return a note to show instead when ``packed`` predates side-file
    checksums, else None."""
    if packed.index.side_files is None:
        return unprotected_note(packed)
    problems = side_file_problems(packed)
    if problems:
        raise PackedFormatError("; ".join(problems))
    return None


def unprotected_note(packed: PackedFile) -> str:
    return (f"{packed.model_dir}: packed before side files were checksummed: its config.json, "
            "generation_config.json and tokenizer files are not protected (a change in them goes "
            "unnoticed); re-pack the model with this coldstart to protect them")
