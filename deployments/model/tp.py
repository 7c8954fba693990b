"""Tensor parallelism for the native decoder: rank K of N computes its slice of every layer.

A rank's model is the ordinary decoder (``llama.Transformer``) of ``weights.tp.rank_config``'s
sizes (H/N query heads, G/N or 1 kv heads, I/N MLP rows, ceil(V/N) vocabulary rows), built by
``build.build_native`` over the rank's tensors exactly as a whole model is (views of the
loader's buffer, q/k/v and gate/up fused as views, kernels chosen for the rank's head counts),
with a ``TensorParallel`` as its ``tp``. The decoder calls it at the four places where the ranks'
work meets, and nowhere else:

- after o_proj and after down_proj: ``all_reduce`` sums the ranks' partial outputs (each rank's
  columns of the row-parallel weight times its heads' or MLP rows' activations; the bias, on
  rank 0 only, is added once);
- the embedding: ``embed`` looks up the ids in the rank's vocabulary range, zeros for the
  others, and sums the ranks' rows (one is not zero: exact);
- the head: ``gather_logits`` all-gathers each rank's logits slice into the whole vocabulary,
  cut to vocab_size (the padding rows' logits are never returned, so they never win).

Every rank ends a step with the same logits. The collectives run on tensors of static shapes,
in place or into an output allocated in the step, with no host synchronisation, so a decode step
stays capturable as a CUDA graph on NCCL (torch.distributed's collectives are capturable there).
A model with ``tp`` None (one device) runs none of this.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weights.tp import Layout, layout

# torch >= 2.12 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallel:
    """One rank's part of a tensor-parallel group: its rank, the group's size, its vocabulary
    range, and the collectives the decoder calls (see the module's docstring).

    Args:
        config: the whole model's HF config.json dict (not a rank's).
        group: the torch.distributed process group of the model's ranks (``dist.group.WORLD``
            for all of them); the rank is the process's rank in it.
    """

    def __init__(self, config: Mapping[str, Any], group: Any):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layout: Layout = layout(config, self.size)
        self.vocab_size = self.layout.vocab
        self.vocab_per_rank = self.layout.vocab_per_rank
        self.vocab_start = self.rank * self.vocab_per_rank

    def __repr__(self) -> str:
        return f"TensorParallel(rank {self.rank} of {self.size})"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (``x`` is a fresh, contiguous activation)."""
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``tokens`` (any shape) from every rank's slice ``weight``
        [vocab_per_rank, hidden]: each rank looks up the ids in its range, zeros elsewhere."""
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        x = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's logits slice [..., vocab_per_rank] -> the whole vocabulary's [..., vocab_size]."""
        lead, n = local.shape[:-1], self.vocab_per_rank
        flat = local.reshape(-1, n).contiguous()
        out = flat.new_empty((self.size * flat.shape[0], n))
        _all_gather(out, flat, group=self.group)  # [rank, row, n]
        full = out.view(self.size, -1, n).transpose(0, 1).reshape(*lead, self.size * n)
        return full[..., : self.vocab_size]


def tensor_parallel(config: Mapping[str, Any], group: Any) -> TensorParallel | None:
    """``TensorParallel`` for ``group``, or None where there is no group or one of a single rank
    (a one-device model: no collectives at all)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return TensorParallel(config, group)
