"""``coldstart pack SRC DEST``: a Hugging Face model directory -> a packed model directory.

Streams tensor by tensor (the model is never instantiated and never held twice
in memory), lays tensors out sorted by name, each 4 KiB-aligned, writes the
chunk checksums and the index, and publishes DEST atomically.

Publishing, --force and leftovers: ``weights.publish``.

Split packs (``--tp N``, ``PackOptions(tp=N)``). The same steps write one
weights file per rank, ``rank-K/model.cst`` (layout: ``weights.format``; the
slicing rules: ``weights.tp``), with ``tp.json`` beside the side files. Each
source tensor is read once and its N slices written, one to each rank's file;
every rank's file has the same layout (the slices have one shape), so each
rank's q/k/v and gate/up lie back to back as in a plain pack. Publishing,
--force, the lock and the leftovers are those of a plain pack: the rank files
are named model.cst only inside the temporary directory, renamed as a whole.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from tqdm import tqdm

from . import checksum, publish, quant, quantize
from . import tp as tensor_parallel
from .format import (ALIGN, DEFAULT_CHUNK_BYTES, DTYPES, PREAMBLE_BYTES, SIDE_FILES,
                     TP_MANIFEST, WEIGHTS_FILE, Index, SideFile, TensorEntry, align_up, encode_preamble,
                     file_sha256, rank_dir, read_json)
from .sources import SourceError, SourceTensor, check_apart, check_source, iter_tensors, open_sources

log = logging.getLogger(__name__)

CAST_DTYPES = ("float32", "float16", "bfloat16")
_PARTIAL = WEIGHTS_FILE + ".partial"  # the weights' name until the pack is complete


@dataclass(frozen=True)
class PackOptions:
    """How to pack.

    Attributes:
        dtype: cast floating-point tensors to this dtype (float32, float16 or
            bfloat16); integer tensors (quantized weights) are stored as they are.
        force: replace an existing DEST, if it is a packed model or an empty directory
            (anything else is never replaced).
        chunk_bytes: checksum chunk size, a multiple of 4096.
        progress: show a progress bar (only on a terminal).
        tp: split the model over this many tensor-parallel ranks, one weights file each
            (``weights.tp``); 1 writes one plain model.cst.
        quantize: "fp8": quantize every layer's projection weights to float8_e4m3fn with one
            float32 scale per output channel (``weights.quant``); config.json gets the matching
            compressed-tensors quantization_config. None: the tensors as the source has them.
    """

    dtype: str | None = None
    force: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    progress: bool = True
    tp: int = 1
    quantize: str | None = None

    def __post_init__(self) -> None:
        if self.quantize is not None and self.quantize not in quant.QUANTIZE_CHOICES:
            raise ValueError(f"quantize={self.quantize!r} is not supported; use one of "
                             f"{', '.join(quant.QUANTIZE_CHOICES)}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"tp={self.tp!r} must be a number of ranks, 1 or more")
        if self.dtype is not None and self.dtype not in CAST_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported for casting; "
                             f"use one of {', '.join(CAST_DTYPES)}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of {ALIGN}")


# Projections a decoder multiplies by the same input: stored back to back (each a
# multiple of 4 KiB in real models), they form one [rows, hidden] matrix that the
# engine uses as a zero-copy view, one matmul instead of three (or two).
_FUSE_RANK = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 3,
              "gate_proj": 4, "up_proj": 5, "down_proj": 6}


def _layout_key(name: str) -> list:
    """Natural order (model.layers.10 after model.layers.9, so the file is in layer
    order), except that within a module q/k/v and gate/up weights sit side by side."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in _FUSE_RANK:
        # ...self_attn.{q,k,v,o}_proj.{weight,bias}: weights together, then biases
        parts = parts[:-2] + [parts[-1], f"{_FUSE_RANK[parts[-2]]}"]
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", ".".join(parts))]


def _stored_dtype(name: str, dtype: str, file: Path, cast: str | None) -> str:
    """The dtype ``name`` is stored as: ``cast`` for floating-point tensors of 2 bytes or more,
    except a quantized layer's scales and zero points (their values are the quantisation's)."""
    tdt = getattr(torch, dtype, None) if dtype in DTYPES else None
    if tdt is None:
        # safetensors codes were mapped to torch already; only odd .bin dtypes land here
        raise SourceError(f"{file}: tensor {name!r} has dtype {dtype}, which a packed file cannot "
                          f"hold; supported: {', '.join(DTYPES)}")
    if cast and tdt.is_floating_point and tdt.itemsize >= 2 and not quant.keeps_dtype(name):
        return cast  # fp8 stays fp8: casting it up would change what was quantized
    return dtype


def pack(src: str | os.PathLike, dest: str | os.PathLike, options: PackOptions | None = None
         ) -> Path:
    """Pack a Hugging Face model directory into a packed model directory.

    Args:
        src: local HF model directory (config.json plus safetensors shards, with
            or without an index, or ``.bin`` files).
        dest: the packed directory to create.
        options: ``PackOptions``; defaults keep dtypes as they are.
    Returns:
        ``dest`` as a Path.
    Raises:
        SourceError: SRC is missing, empty, has no config or weights, a bad shard,
            a duplicate or unsupported tensor.
        ValueError: DEST is SRC, contains it or lies inside it (symlinks resolved).
        FileExistsError: DEST exists and ``force`` is not set, or DEST is something
            other than a packed model or an empty directory (never replaced).

    Example:
        >>> pack("Llama-2-7b-hf", "weights/llama-2-7b", PackOptions(dtype="float16"))
    """
    opts = options or PackOptions()
    src, dest = Path(src), Path(dest)
    files = check_source(src)
    check_apart(src, dest)
    publish.check_replace(dest, opts.force)
    metas, handles, aliases = open_sources(files)
    try:
        if not metas:
            raise SourceError(f"{src}: the weight files hold no tensors")
        stream = iter_tensors(files, handles, skip=set(aliases))
        if opts.quantize:
            _scheme(src, opts)  # (a quantized source is refused as such first)
            if not any(quant.is_projection_weight(n, m.shape) for n, m in metas.items()):
                raise SourceError(f"{src}: --quantize {opts.quantize}: no layer projections to quantize "
                                  f"(model.layers.N.*.{{{','.join(quant.PROJECTIONS)}}}.weight): only Llama, "
                                  "Mistral and Qwen2 checkpoints are quantized at pack time")
            metas, stream = quantize.fp8_metas(metas), quantize.fp8_stream(stream)
        return write_pack(src, dest, metas, stream, aliases, opts)
    finally:
        for h in handles:
            if hasattr(h, "close"):
                h.close()


TensorStream = Iterable[tuple[str, torch.Tensor, "Path | str"]]


def write_pack(src: Path, dest: Path, metas: dict[str, SourceTensor], tensors: TensorStream,
               aliases: dict[str, str], opts: PackOptions, source: str | None = None) -> Path:
    """Lay out, write and publish a packed model at ``dest`` (under DEST's lock, atomically, as the
    module's docstring says): the tensors ``metas`` describes, arriving from ``tensors`` as
    (name, tensor, where it comes from), each once, in any order; split over ``opts.tp`` ranks
    when that is above 1; side files copied from ``src``. ``pack`` gives it a checkpoint's
    tensors, ``weights.demo`` random ones. ``source``: recorded in the index (SRC's name)."""
    scheme = _scheme(src, opts)
    by_name, data_bytes, lay = _layout(src, metas, aliases, opts)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with publish.locked(dest) as locked:
        publish.check_replace(dest, opts.force)  # again: another pack may have published it meanwhile
        publish.remove_leftovers(dest, src, locked)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-{publish.owner()}-", dir=dest.parent))
        try:
            meta = {"source": source or src.name, "cast": opts.dtype,
                    "quantization": scheme.to_json() if scheme else None}
            _write_pack(tmp, src, tensors, by_name, data_bytes, aliases, opts, lay, meta)
            publish.publish(tmp, dest, opts.force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    split = f" split over {opts.tp} ranks" if lay else ""
    log.info("packed %d tensors (%.2f GB%s) from %s into %s", len(by_name), opts.tp * data_bytes / 1e9, split,
             source or src, dest)
    return dest


def _scheme(src: Path, opts: PackOptions) -> "quant.QuantScheme | None":
    """The pack's quantization scheme (recorded in its index): the source's, or --quantize's.
    SourceError naming the field for a scheme the decoder does not run, and for --quantize of a
    quantized source."""
    config = read_json(src / "config.json", "fix it, or re-download the model")
    try:
        scheme = quant.scheme_of(config)
    except ValueError as e:
        raise SourceError(f"{src}: {e}") from None
    if scheme and opts.quantize:
        raise SourceError(f"{src}: --quantize {opts.quantize}: the checkpoint is quantized already "
                          f"({scheme.describe()}); pack it without --quantize")
    if opts.quantize:
        scheme = quant.scheme_of(quant.fp8_config(config))
    return scheme


def _layout(src: Path, metas: dict[str, SourceTensor], aliases: dict[str, str], opts: PackOptions
            ) -> tuple[dict[str, TensorEntry], int, "tensor_parallel.Layout | None"]:
    """Every tensor's entry (metadata only, so each can be written where it belongs as it
    arrives), the data region's size, and the split over ranks (None for a plain pack); a rank's
    entries are those of a slice, the same for every rank. SourceError for a model that does not
    split over ``opts.tp`` ranks."""
    lay = None
    try:
        if opts.tp > 1:
            config = read_json(src / "config.json", "fix it or pack without --tp")
            lay = tensor_parallel.layout(quant.fp8_config(config) if opts.quantize else config, opts.tp)
            for a, target in aliases.items():
                if tensor_parallel.rule(a) != tensor_parallel.rule(target):
                    raise ValueError(f"tensor {a!r} shares its storage with {target!r}, which is split otherwise")
        shapes = {n: m.shape if lay is None else tensor_parallel.shard_shape(n, m.shape, lay)
                  for n, m in metas.items()}
    except ValueError as e:
        raise SourceError(f"{src}: {e}") from None
    entries: list[TensorEntry] = []
    off = 0
    for name in sorted(metas, key=_layout_key):
        m = metas[name]
        stored = _stored_dtype(name, m.dtype, m.file, opts.dtype)
        nbytes = int(np.prod(shapes[name], dtype=np.int64)) * DTYPES[stored][0]
        entries.append(TensorEntry(name, stored, shapes[name], off, nbytes))
        off = align_up(off + nbytes)
    return {e.name: e for e in entries}, max(align_up(off), ALIGN), lay


def _write_pack(tmp: Path, src: Path, tensors: TensorStream, by_name: dict[str, TensorEntry], data_bytes: int,
                aliases: dict[str, str], opts: PackOptions, lay: "tensor_parallel.Layout | None",
                meta: dict) -> None:
    """Write the packed model into ``tmp``: side files (and a split pack's tp.json), then the
    weights as model.cst.partial (one per rank's directory in a split pack), each renamed
    model.cst once complete, all fsynced (see the module's docstring for why)."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
    side = _copy_side_files(src, tmp)
    if opts.quantize:  # the pack's config.json says how its weights are stored
        cfg = tmp / "config.json"
        cfg.write_text(json.dumps(quant.fp8_config(read_json(cfg, "fix it")), indent=2))
        publish.fsync(cfg)
        side["config.json"] = SideFile(file_sha256(cfg), cfg.stat().st_size)
    paths, metadata = [tmp / _PARTIAL], [meta]
    if lay is not None:
        side[TP_MANIFEST] = _write_manifest(tmp, lay)
        paths = [tmp / rank_dir(k) / _PARTIAL for k in range(lay.size)]
        metadata = [{**meta, "tp": {"size": lay.size, "rank": k}} for k in range(lay.size)]
        for path in paths:
            path.parent.mkdir(mode=0o755)
    _write_weights(paths, tensors, by_name, data_bytes, aliases, opts, metadata, side, lay)
    for path in paths:
        os.rename(path, path.with_name(WEIGHTS_FILE))  # complete from here on (inside tmp)
    _fsync_dir(tmp)


def _copy_side_files(src: Path, tmp: Path) -> dict[str, SideFile]:
    """Copy SRC's side files into ``tmp``, each fsynced; their index entries, hashed from the
    copies (what the packed directory will hold)."""
    out = {}
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
            publish.fsync(tmp / name)
            out[name] = SideFile(file_sha256(tmp / name), (tmp / name).stat().st_size)
    return out


def _write_manifest(tmp: Path, lay: "tensor_parallel.Layout") -> SideFile:
    """A split pack's tp.json, fsynced; its index entry (every rank's index lists it)."""
    path = tmp / TP_MANIFEST
    path.write_text(json.dumps(tensor_parallel.manifest(lay, secrets.token_hex(8)), indent=1))
    publish.fsync(path)
    return SideFile(file_sha256(path), path.stat().st_size)


def _write_weights(paths: list[Path], tensors: TensorStream, by_name: dict[str, TensorEntry], data_bytes: int,
                   aliases: dict[str, str], opts: PackOptions, metadata: list[dict], side: dict[str, SideFile],
                   lay: "tensor_parallel.Layout | None") -> None:
    """Each tensor once, as it arrives: its one slice per file of ``paths`` (the tensor itself for
    a plain pack) cast and written at its offset; then each file's sums, index and preamble."""
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            os.ftruncate(fds[-1], PREAMBLE_BYTES + data_bytes)  # zero padding for free (sparse)
        bar = _progress(len(paths) * sum(e.nbytes for e in by_name.values()), opts.progress)
        scheme = metadata[0].get("quantization")
        for name, t, file in tensors:
            e = by_name[name]
            if name.endswith(".g_idx") and scheme and scheme["method"] == "gptq" and not scheme["act_order"]:
                if not _in_row_order(t, scheme["group_size"]):
                    raise SourceError(f"{file}: tensor {name!r} orders the input rows' groups otherwise than k // "
                                      f"group_size ({scheme['group_size']}), while config.json's "
                                      "quantization_config.desc_act is false: a checkpoint quantized with "
                                      "act-order needs desc_act: true")
            pieces = [t] if lay is None else [tensor_parallel.shard(name, t, lay, k) for k in range(lay.size)]
            for fd, piece in zip(fds, pieces):
                if tuple(piece.shape) != e.shape:
                    raise SourceError(f"{file}: tensor {name!r} changed shape while reading")
                piece = piece.to(getattr(torch, e.dtype)) if str(piece.dtype) != f"torch.{e.dtype}" else piece
                buf = piece.contiguous().view(-1).view(torch.uint8).numpy()
                _pwrite_all(fd, buf, PREAMBLE_BYTES + e.offset, file, name)
                bar.update(e.nbytes)
        bar.close()
        for fd, path, meta in zip(fds, paths, metadata):
            _finish_weights(fd, path, by_name, data_bytes, aliases, opts, meta, side)
    finally:
        for fd in fds:
            os.close(fd)


def _in_row_order(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether a GPTQ ``g_idx`` is ``k // group_size``, as it must be without act-order
    (``desc_act`` false): the decoder then reads the groups in that order and no g_idx."""
    k = g_idx.numel()
    return torch.equal(g_idx.to(torch.int64).view(-1), torch.arange(k) // (group_size if group_size > 0 else k))


def _finish_weights(fd: int, path: Path, by_name: dict[str, TensorEntry], data_bytes: int,
                    aliases: dict[str, str], opts: PackOptions, meta: dict, side: dict[str, SideFile]) -> None:
    """A weights file whose data is written: its chunk sums, its index, and last its preamble."""
    # Sums over what is on disk now (mostly still in the page cache), via a map.
    # mode "c": a private map torch may wrap without a read-only warning; never written
    region = np.memmap(path, dtype=np.uint8, mode="c", offset=PREAMBLE_BYTES, shape=(data_bytes,))
    sums = checksum.chunk_sums(torch.from_numpy(region), opts.chunk_bytes)
    del region
    index = Index(sorted(by_name.values(), key=lambda e: e.offset), opts.chunk_bytes, sums,
                  aliases, meta, side).to_bytes()
    _pwrite_all(fd, np.frombuffer(index, np.uint8), PREAMBLE_BYTES + data_bytes, path, "index")
    # The preamble goes last: until it is written the file has no valid magic.
    _pwrite_all(fd, np.frombuffer(encode_preamble(data_bytes, index), np.uint8), 0, path, "header")
    os.fsync(fd)


def _pwrite_all(fd: int, buf: np.ndarray, offset: int, file, name: str) -> None:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write of {name!r} from {file}")
        done += n


def _fsync_dir(d: Path) -> None:
    """Every file under ``d`` (a split pack's rank directories too), then the directories."""
    for p in d.iterdir():
        if p.is_dir() and not p.is_symlink():
            _fsync_dir(p)
        elif p.is_file():
            publish.fsync(p)
    publish.fsync(d)


def _progress(total: int, enabled: bool) -> tqdm:
    """The pack's byte count as a bar on a terminal; a bar that draws nothing otherwise."""
    return tqdm(total=total, unit="B", unit_scale=True, desc="pack",
                disable=not enabled or not sys.stderr.isatty())
