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
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .format import MANIFEST_FORMAT, TP_MANIFEST, rank_dir, read_manifest

# the kinds of rule (see the module's docstring)
Q_ROWS, KV_ROWS, Q_COLUMNS, MLP_ROWS, MLP_COLUMNS, FIRST, VOCAB, REPLICATED = (
    "q_rows", "kv_rows", "q_columns", "mlp_rows", "mlp_columns", "rank0", "vocab", "replicated")

_PROJ = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")
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
    return Layout(size, heads, kv, int(head_dim), inter, vocab)


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
    m = _PROJ.search(name)
    if m:
        return _PROJ_KIND[m.group(1), m.group(2)]
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


def shard_shape(name: str, shape: tuple[int, ...], lay: Layout) -> tuple[int, ...]:
    """The shape of every rank's slice of tensor ``name`` of ``shape`` (the same on every rank)."""
    kind, dim, unit, units = _split(name, tuple(shape), lay)
    if kind in (FIRST, REPLICATED):
        return tuple(shape)
    return tuple(unit * units if d == dim else n for d, n in enumerate(shape))


def shard(name: str, t: Any, lay: Layout, rank: int) -> Any:
    """Rank ``rank``'s slice of tensor ``t`` (a torch.Tensor named ``name``): a view of ``t`` where
    it can be (rows; columns are a strided view), a new tensor for the vocabulary's zero-padded
    last rows and for the zeros of a row-parallel bias on ranks other than 0."""
    if not 0 <= rank < lay.size:
        raise ValueError(f"rank {rank} is outside 0..{lay.size - 1}")
    kind, dim, unit, units = _split(name, tuple(t.shape), lay)
    if kind == REPLICATED:
        return t
    if kind == FIRST:
        return t if rank == 0 else t.new_zeros(t.shape)
    first = lay.kv_start(rank) if kind == KV_ROWS else rank * units
    start, length = first * unit, units * unit
    have = max(0, min(length, t.shape[dim] - start))  # < length only in the vocabulary's padding
    if have == length:
        return t.narrow(dim, start, length)
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
