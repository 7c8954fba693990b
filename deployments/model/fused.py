"""Fused projections as views: q/k/v and gate/up as one matrix each, where the packer laid
their weights back to back in the loader's buffer (no copy; one matmul instead of three).
Quantized projections fuse where their scheme can read the parts as one layer
(``QuantMethod.fuse``: fp8 weights as a view, their scales copied, as the biases are)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deployments.model.quant import QuantLinear


def adjacent_view(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """``ts`` stacked along dim 0 as ONE view, if they lie back to back in one storage.

    No copy is ever made: None when they are not adjacent (other loaders, padding
    between small tensors), and the caller keeps the separate matmuls.
    """
    first = ts[0]
    base = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in ts:
        if (t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base or t.data_ptr() != end or end == 0):
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in ts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _bias(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if ts[0] is None:
        return None
    # biases are 4 KiB-padded apart in a packed file; a few KB per layer, so a copy is fine
    # (refresh_copies makes it again when the weights' bytes arrive after the build)
    return adjacent_view(ts) if adjacent_view(ts) is not None else torch.cat(ts)


def refresh_copies(model: Any) -> int:
    """Copy again, in place, what the build copied out of the weights (fused biases that
    were not adjacent), for a model built over a buffer that was still loading. In place,
    because captured CUDA graphs hold these tensors' addresses. Returns how many."""
    n = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for fused in (a.qkv_w, m.gate_up_w):
            if isinstance(fused, QuantLinear):
                n += fused.method.refresh_fused(fused)
        for fused, parts in ((a.qkv_b, [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                             (m.gate_up_b, [m.gate_proj.bias, m.up_proj.bias])):
            if fused is not None and adjacent_view(parts) is None:
                fused.copy_(torch.cat(parts))
                n += 1
    return n


def fuse_projections(model: Any) -> int:
    """Point every layer's fused q/k/v and gate/up weights at adjacent views; returns how
    many of the 2 x layers matrices could be fused."""
    n = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for owner, w, b, parts in ((a, "qkv_w", "qkv_b", [a.q_proj, a.k_proj, a.v_proj]),
                                   (m, "gate_up_w", "gate_up_b", [m.gate_proj, m.up_proj])):
            if all(type(p) is nn.Linear for p in parts):
                fused = adjacent_view([p.weight for p in parts])
                if fused is not None:
                    setattr(owner, w, fused)
                    setattr(owner, b, _bias([p.bias for p in parts]))
            elif all(isinstance(p, QuantLinear) and p.method is parts[0].method for p in parts):
                stored = [getattr(p, "weight", None) for p in parts]  # (fp8's; int4 layers have none)
                fused = parts[0].method.fuse(parts, None if None in stored else adjacent_view(stored))
                # held outside the module tree: its tensors are the parts' views (and a copy of their
                # scales), not parameters of their own
                owner.__dict__[w] = fused
            else:
                fused = None
            n += fused is not None
    return n
