"""Tensor parallelism's sharding rules: which slice of each checkpoint tensor rank K of N holds.

The one source of truth for them: ``coldstart pack --tp N`` (``weights.packer``), ``coldstart demo
--tp N`` (``weights.demo``), the native decoder's rank model (``deployments.model.tp``, built from
``rank_config``) and the tests all slice through this module. It imports no torch (``shard`` only
calls methods of the tensor it is given) and no deployments code.

H = num_attention_heads, G = num_key_value_heads, Dh = head size, I = intermediate_size,
V = vocab_size, N ranks, Vr = ceil(V / N)::

    tensor                                  rank K holds                                   kind
    self_attn.q_proj.weight, .bias          rows of query heads [K*H/N, (K+1)*H/N)          column-parallel
    self_attn.k_proj / v_proj .weight, .bias
                                            G % N == 0: rows of kv heads [K*G/N, (K+1)*G/N)  column-parallel
                                            N % G == 0: the rows of kv head K // (N/G), the one
                                              its query heads read (the same on N/G ranks)
    self_attn.o_proj.weight                 columns of its query heads                      row-parallel
    mlp.gate_proj / up_proj .weight, .bias  rows [K*I/N, (K+1)*I/N)                          column-parallel
    mlp.down_proj.weight                    columns [K*I/N, (K+1)*I/N)                       row-parallel
    self_attn.o_proj.bias, mlp.down_proj.bias
                                            rank 0: the bias; other ranks: zeros of its shape
    model.embed_tokens.weight, lm_head.weight
                                            rows [K*Vr, (K+1)*Vr) of the vocabulary; rows
                                              past V (the last rank's padding) are zeros        vocab-parallel
    *norm.weight, rotary_emb.inv_freq       all of it                                       replicated

Why. Column-parallel outputs are the rank's heads (or MLP rows) in full, so attention and the
activation run per rank without any exchange; a row-parallel product is a partial sum, and the
decoder sums the ranks' partials with one all-reduce after o_proj and one after down_proj. A
row-parallel bias is held by rank 0 alone so that the sum adds it once, exactly (a bias divided by
N would not sum back to itself in fp16). The embedding is vocab-parallel: a rank looks up the ids
in its range, zeros elsewhere, and an all-reduce sums the N rows (one is non-zero, so the sum is
exact); the head gives each rank the logits of its range, all-gathered to N*Vr and cut to V, so
the zero padding rows' logits never reach a sampler. Tied embeddings (tie_word_embeddings): the
head is the embedding, split the same way; a stored lm_head.weight is split like it. Grouped-query
attention with fewer kv heads than ranks replicates each kv head on the ranks whose query heads
read it: every rank holds (and caches) exactly the kv heads its queries need.

Requirements: H % N == 0, G % N == 0 or N % G == 0, I % N == 0; otherwise ``layout`` raises a
ValueError naming the fields. A tensor without a rule (another architecture's) is refused by name.

Quantized checkpoints (``weights.quant``). A projection's other tensors follow its weight: where
the weight is split by output rows (column-parallel), each tensor that has an output axis is cut
along it; where by input columns (row-parallel), along its input axis; a tensor without that axis
is whole on every rank (a per-tensor scale, a column-parallel layer's ``g_idx``, a row-parallel
layer's per-channel ``weight_scale``). Along an axis a tensor may hold one entry per several
weight elements (an AWQ / GPTQ word: 8; a group: group_size; an fp8 block: weight_block_size);
a rank's slice must start and end on such a boundary, or the split is refused naming the field.
A row-parallel GPTQ ``g_idx`` is rebased to its rank's first group; act-order GPTQ (groups
scattered over the input rows) does not split by rows and is refused (desc_act).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import quant
from .format import (MANIFEST_FORMAT, TP_MANIFEST, rank_dir,
                     read_manifest)

# the kinds of rule (see the module's docstring)
Q_ROWS, KV_ROWS, Q_COLUMNS, MLP_ROWS, MLP_COLUMNS, FIRST, VOCAB, REPLICATED = (
    "q_rows", "kv_rows", "q_columns", "mlp_rows", "mlp_columns", "rank0", "vocab", "replicated")

_PROJ = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")
_QUANT = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.("
                    + "|".join(quant.QUANT_PARAMS) + r")$")
_PROJ_KIND = {("q_proj", "weight"): Q_ROWS, ("q_proj", "bias"): Q_ROWS,
              ("k_proj", "weight"): KV_ROWS, ("k_proj", "bias"): KV_ROWS,
              ("v_proj", "weight"): KV_ROWS, ("v_proj", "bias"): KV_ROWS,
              ("o_proj", "weight"): Q_COLUMNS, ("o_proj", "bias"): FIRST,
              ("gate_proj", "weight"): MLP_ROWS, ("gate_proj", "bias"): MLP_ROWS,
              ("up_proj", "weight"): MLP_ROWS, ("up_proj", "bias"): MLP_ROWS,
              ("down_proj", "weight"): MLP_COLUMNS, ("down_proj", "bias"): FIRST}


@dataclass(frozen=True)
class Layout:
    """How a model of these sizes splits over ``size`` ranks (made and checked by ``layout``)."""

    size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    scheme: "quant.QuantScheme | None" = None  # the checkpoint's quantization (None: plain weights)

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.size

    @property
    def kv_per_rank(self) -> int:
        """kv heads each rank holds: G/N, or 1 where kv heads are replicated (G < N)."""
        return max(1, self.kv_heads // self.size)

    @property
    def kv_replicated(self) -> bool:
        return self.kv_heads < self.size

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab // self.size)

    @property
    def vocab_padded(self) -> int:
        return self.vocab_per_rank * self.size

    def kv_start(self, rank: int) -> int:
        """The first kv head rank ``rank`` holds."""
        if self.kv_replicated:
            return rank // (self.size // self.kv_heads)
        return rank * self.kv_per_rank

    def to_json(self) -> dict:
        return {"size": self.size, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate, "vocab_size": self.vocab,
                "heads_per_rank": self.heads_per_rank, "kv_heads_per_rank": self.kv_per_rank,
                "kv_replicated": self.kv_replicated, "intermediate_per_rank": self.intermediate_per_rank,
                "vocab_per_rank": self.vocab_per_rank, "vocab_padded": self.vocab_padded}


def _positive(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"config.json: `{name}` must be a positive int to split the model over ranks, got {v!r}")
    return v


def layout(config: Mapping[str, Any], size: int) -> Layout:
    """The split of the model ``config`` (an HF config.json dict) over ``size`` ranks.

    Raises ValueError naming the field when heads, kv heads or the MLP width do not divide
    over ``size`` ranks (see the module's docstring for what must hold)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor parallelism: the number of ranks must be an int >= 1, got {size!r}")
    heads = _positive("num_attention_heads", config.get("num_attention_heads"))
    kv = _positive("num_key_value_heads", config.get("num_key_value_heads") or heads)  # absent: heads
    head_dim = config.get("head_dim") or _positive("hidden_size", config.get("hidden_size")) // heads
    inter = _positive("intermediate_size", config.get("intermediate_size"))
    vocab = _positive("vocab_size", config.get("vocab_size"))
    fix = "choose a number of ranks that divides it"
    if heads % size:
        raise ValueError(f"tensor parallelism over {size} ranks: num_attention_heads ({heads}) is not a "
                         f"multiple of {size}; {fix}")
    if kv % size and size % kv:
        raise ValueError(f"tensor parallelism over {size} ranks: num_key_value_heads ({kv}) must be a multiple "
                         f"of {size} (kv heads split) or divide it (kv heads replicated); {fix}")
    if inter % size:
        raise ValueError(f"tensor parallelism over {size} ranks: intermediate_size ({inter}) is not a multiple "
                         f"of {size}; {fix}")
    scheme = quant.scheme_of(config)
    if scheme is not None and scheme.act_order and size > 1:
        raise ValueError(f"tensor parallelism over {size} ranks: quantization_config.desc_act=True (act-order "
                         "GPTQ) scatters each group over the input rows, so o_proj and down_proj cannot be split "
                         "by rows; serve it on one device, or quantize it without act-order")
    return Layout(size, heads, kv, int(head_dim), inter, vocab, scheme)


def rank_config(config: Mapping[str, Any], size: int) -> dict:
    """The config.json of one rank's model: the same model with the heads, kv heads, MLP rows and
    vocabulary rows one rank holds (the same for every rank); ``head_dim`` is written out, since
    hidden_size // heads no longer gives it."""
    lay = layout(config, size)
    return {**config, "num_attention_heads": lay.heads_per_rank, "num_key_value_heads": lay.kv_per_rank,
            "head_dim": lay.head_dim, "intermediate_size": lay.intermediate_per_rank,
            "vocab_size": lay.vocab_per_rank}


def rule(name: str) -> str:
    """The kind of split of tensor ``name`` (one of this module's kind constants); ValueError
    naming it when no rule covers it."""
    m = _PROJ.search(name) or _QUANT.search(name)
    if m:
        return _PROJ_KIND[m.group(1), "bias" if m.group(2) == "bias" else "weight"]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return VOCAB
    if name.endswith(("norm.weight", "rotary_emb.inv_freq")):
        return REPLICATED
    raise ValueError(f"tensor {name!r} has no tensor-parallel rule (split packs hold Llama, Mistral and "
                     "Qwen2 checkpoints: projections, embeddings, norms); pack this model without --tp")


def _split(name: str, shape: tuple[int, ...], lay: Layout) -> tuple[str, int, int, int]:
    """(kind, dim, rows per unit, units per rank): a split's geometry, checked against ``shape``."""
    kind = rule(name)
    per_head = {Q_ROWS: lay.heads, KV_ROWS: lay.kv_heads, Q_COLUMNS: lay.heads}
    if kind in per_head:
        dim = 1 if kind == Q_COLUMNS else 0
        units = lay.kv_per_rank if kind == KV_ROWS else lay.heads_per_rank
        want = per_head[kind] * lay.head_dim
        if len(shape) <= dim or shape[dim] != want:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}: dimension {dim} should be {want} "
                             f"({per_head[kind]} heads of {lay.head_dim}) for config.json's sizes")
        return kind, dim, lay.head_dim, units
    if kind in (MLP_ROWS, MLP_COLUMNS):
        dim = 1 if kind == MLP_COLUMNS else 0
        if len(shape) <= dim or shape[dim] != lay.intermediate:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}: dimension {dim} should be "
                             f"intermediate_size ({lay.intermediate})")
        return kind, dim, 1, lay.intermediate_per_rank
    if kind == VOCAB:
        if not shape or shape[0] != lay.vocab:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}: dimension 0 should be vocab_size "
                             f"({lay.vocab})")
        return kind, 0, 1, lay.vocab_per_rank
    return kind, 0, 0, 0


_OUT_KINDS = (Q_ROWS, KV_ROWS, MLP_ROWS)  # the weight split by output rows; else by input columns


def _axes(name: str, shape: tuple[int, ...], lay: Layout) -> dict[str, tuple[int, int, str]]:
    """Where a quantized projection's tensor holds the weight's output ("out") and input ("in")
    axes: {axis: (dim, weight elements per entry, the config field that sets that number)}."""
    sch, suffix = lay.scheme, name.rsplit(".", 1)[1]
    if sch is None:
        raise ValueError(f"tensor {name!r} holds quantization data, and config.json has no quantization_config; "
                         "re-export the checkpoint with its quantization_config")
    g = (sch.group_size, "quantization_config.group_size")
    word = (8, "quantization_config.bits (eight 4-bit values per int32 word)")
    if suffix == "weight_scale":
        return {"out": (0, 1, "")} if len(shape) == 2 and shape[0] > 1 else {}
    if suffix == "weight_scale_inv":
        bn, bk = sch.block or (1, 1)
        return {"out": (0, bn, "quantization_config.weight_block_size"),
                "in": (1, bk, "quantization_config.weight_block_size")}
    if suffix in ("qzeros", "scales"):
        return {"in": (0, *g), "out": (1, *(word if suffix == "qzeros" else (1, "")))}
    if suffix == "qweight":
        return {"in": (0, 1, ""), "out": (1, *word)} if sch.method == "awq" else {"in": (0, *word), "out": (1, 1, "")}
    if suffix == "g_idx":
        return {"in": (0, 1, "")}
    return {}  # input_scale, weight_zero_point: one value


def _quant_slice(name: str, shape: tuple[int, ...], lay: Layout, rank: int) -> tuple[str, int, int, int]:
    """(kind, dim, start, length) of rank ``rank``'s slice of a quantized projection's tensor, in
    its own entries (see the module's docstring); ValueError naming the field where a slice would
    not start and end on an entry's boundary."""
    kind = rule(name)
    _, _, unit, units = _split(name.rsplit(".", 1)[0] + ".weight", _weight_shape(kind, lay), lay)
    axis = "out" if kind in _OUT_KINDS else "in"
    where = _axes(name, shape, lay).get(axis)
    if where is None:
        return REPLICATED, 0, 0, 0
    dim, per, field = where
    if per == -1:  # group_size -1: one group spans the whole input
        per = _weight_shape(kind, lay)[1]
    first = lay.kv_start(rank) if kind == KV_ROWS else rank * units
    start, length = first * unit, units * unit
    what = "output rows" if axis == "out" else "input columns"
    if start % per or length % per:
        raise ValueError(f"tensor {name!r}: rank {rank}'s slice ({what} {start}..{start + length}) would cut the "
                         f"{per}-element units of {field}; choose a number of ranks whose slices keep them whole, "
                         "or serve the model on one device")
    if len(shape) <= dim or shape[dim] != -(-_weight_shape(kind, lay)[0 if axis == "out" else 1] // per):
        raise ValueError(f"tensor {name!r} has shape {list(shape)}: dimension {dim} does not match its weight's "
                         f"{what} for config.json's sizes and quantization_config")
    return kind, dim, start // per, length // per


def _slice(name: str, shape: tuple[int, ...], lay: Layout, rank: int) -> tuple[str, int, int, int]:
    """(kind, dim, start, length) of rank ``rank``'s slice of tensor ``name`` (length: the slice's
    size along dim, the same on every rank)."""
    if _QUANT.search(name):
        return _quant_slice(name, shape, lay, rank)
    kind, dim, unit, units = _split(name, shape, lay)
    first = lay.kv_start(rank) if kind == KV_ROWS else rank * units
    return kind, dim, first * unit, units * unit


def _rebased_groups(name: str, g_idx: Any, start: int, length: int, lay: Layout) -> Any:
    """A row-parallel GPTQ g_idx slice, counting groups from the rank's first; ValueError where a
    row's group lies outside the rank's rows (groups not in row order)."""
    group = lay.scheme.group_size
    out = g_idx - start // group
    if int(out.min()) < 0 or int(out.max()) >= length // group:
        raise ValueError(f"tensor {name!r}: its groups are not in row order (act-order), so its input rows "
                         "cannot be split over ranks (quantization_config.desc_act); serve it on one device")
    return out


def _weight_shape(kind: str, lay: Layout) -> tuple[int, int]:
    """A projection weight's [out, in] for the kind of split it gets (the checked sizes of config.json)."""
    q, kv, hidden = lay.heads * lay.head_dim, lay.kv_heads * lay.head_dim, 0  # (hidden: never split)
    rows = {Q_ROWS: q, KV_ROWS: kv, MLP_ROWS: lay.intermediate}
    cols = {Q_COLUMNS: q, MLP_COLUMNS: lay.intermediate}
    return (rows[kind], hidden) if kind in rows else (hidden, cols[kind])


def shard_shape(name: str, shape: tuple[int, ...], lay: Layout) -> tuple[int, ...]:
    """The shape of every rank's slice of tensor ``name`` of ``shape`` (the same on every rank);
    ValueError where a rank's slice of a quantized tensor would cut its units."""
    for rank in range(lay.size):  # (each rank's bounds checked once, here, before anything is written)
        kind, dim, _, length = _slice(name, tuple(shape), lay, rank)
    if kind in (FIRST, REPLICATED):
        return tuple(shape)
    return tuple(length if d == dim else n for d, n in enumerate(shape))


def shard(name: str, t: Any, lay: Layout, rank: int) -> Any:
    """Rank ``rank``'s slice of tensor ``t`` (a torch.Tensor named ``name``): a view of ``t`` where
    it can be (rows; columns are a strided view), a new tensor for the vocabulary's zero-padded
    last rows, for the zeros of a row-parallel bias on ranks other than 0 and for a row-parallel
    GPTQ g_idx (rebased to the rank's first group)."""
    if not 0 <= rank < lay.size:
        raise ValueError(f"rank {rank} is outside 0..{lay.size - 1}")
    kind, dim, start, length = _slice(name, tuple(t.shape), lay, rank)
    if kind == REPLICATED:
        return t
    if kind == FIRST:
        return t if rank == 0 else t.new_zeros(t.shape)
    have = max(0, min(length, t.shape[dim] - start))  # < length only in the vocabulary's padding
    if have == length:
        out = t.narrow(dim, start, length)
        if name.endswith(".g_idx"):
            out = _rebased_groups(name, out, start, length, lay)
        return out
    out = t.new_zeros(shard_shape(name, tuple(t.shape), lay))
    if have:
        out.narrow(dim, 0, have).copy_(t.narrow(dim, start, have))
    return out


# ----------------------------------------------------------------------------- a split pack on disk
# (the layout is described in weights.format's docstring, which reads it: read_manifest)


def manifest(lay: Layout, pack_id: str) -> dict:
    """What a split pack's ``tp.json`` holds: the number of ranks, each rank's directory, the
    layout, and an id of the pack (every rank's index records tp.json's sha256, so a rank file
    from another pack is refused)."""
    return {"format": MANIFEST_FORMAT, "version": 1, "size": lay.size,
            "ranks": [rank_dir(k) for k in range(lay.size)], "layout": lay.to_json(), "pack_id": pack_id}


def is_split_pack(dest: str | os.PathLike) -> bool:
    """Whether ``dest`` is a tensor-parallel pack (its tp.json), not a plain packed model."""
    return (Path(dest) / TP_MANIFEST).is_file()


def rank_path(dest: str | os.PathLike, rank: int) -> Path:
    """The directory of rank ``rank``'s weights in the split pack ``dest``; ValueError when
    ``dest`` is not a split pack or has no such rank."""
    d = Path(dest)
    if not is_split_pack(d):
        raise ValueError(f"rank={rank}: {d} is not a tensor-parallel pack (no {TP_MANIFEST}); load it "
                         "without a rank")
    size = read_manifest(d)["size"]
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise ValueError(f"rank={rank!r}: {d} is split over {size} ranks, 0 to {size - 1}")
    return d / rank_dir(rank)
