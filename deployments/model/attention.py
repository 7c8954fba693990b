"""The decoder's attention: one layer's projections, rotary embedding, and its keys and values
read from and written to the KV cache (static slots or paged blocks) in the three modes an
``AttnContext`` names (see ``deployments.model.llama``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deployments.kernels import ops
from deployments.model.config import ModelConfig
from deployments.model.kv_cache import KVCache, PagedKVCache

# `enable_gqa` in SDPA arrived in torch 2.5; pyproject allows 2.4.
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
# Attention backends of the model's SDPA calls on a GPU: not cuDNN's, which torch prefers on
# an H200. cuDNN builds a plan per shape and per thread (the handles are per thread): tens of
# milliseconds for the first prefill of each length in a new thread, several times the prefill
# itself, and its libraries load on first use. Flash attention has no such set-up; the others
# are its fallbacks. Its price: a short prompt's first token a few ms later than with cuDNN.
_SDPA_BACKENDS: list = []
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # torch < 2.3: its own choice
    pass


@dataclass
class AttnContext:
    """How attention gets its keys/values in one forward call (shared by all layers)."""

    mode: str  # "nocache" | "prefill" | "decode"
    cos: torch.Tensor  # [B, S, Dh] in model dtype
    sin: torch.Tensor  # sign-folded: [-sin | sin] over the two halves of Dh
    masks: dict  # window (None = full) -> bool mask, True = attend; None when not needed
    cache: KVCache | PagedKVCache | None = None
    slot: int = 0  # prefill
    start: int = 0  # prefill: position of the chunk's first token
    slots: torch.Tensor | None = None  # prefill of several prompts (each at ``start``): [B] cache slot of each row
    positions: torch.Tensor | None = None  # decode: [B] int64
    # decode, the Triton attention: each row reads its keys up to this position; a padding row's
    # is 0 (one key, where its own position would make it read the whole cache)
    read_positions: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # decode: arange(B)
    kv_len: int = 0  # decode: keys read from the cache
    fused: bool = False  # use deployments.kernels (CUDA with Triton)
    attention_kernel: bool = False  # decode attention through kernels.decode_attention too
    gemv: frozenset = frozenset()  # weight shapes (N, K) a single row multiplies with kernels.gemv
    # a paged cache's index tensors of this forward, made by its first layer and used by every
    # layer (the rows' slots, the written positions' blocks and offsets, the blocks read back)
    paged_index: dict = field(default_factory=dict)

    def prefill_slots(self, device: torch.device) -> torch.Tensor:
        """A prefill's cache slot of each row: ``slots``, or the one ``slot`` (on ``device``)."""
        return self.slots if self.slots is not None else torch.tensor([self.slot], device=device)


def linear(x: torch.Tensor, w: torch.Tensor | nn.Module, b: torch.Tensor | None, ctx: AttnContext | None
           ) -> torch.Tensor:
    """F.linear, or the Triton GEMV for one row when the model chose it for w's shape. ``w`` may
    be a layer that multiplies by its own weight instead (a quantized projection's, or fused ones':
    deployments.model.quant); ``b`` is then None (the layer adds its own)."""
    if isinstance(w, nn.Module):
        return w(x)
    if ctx is not None and ctx.gemv and x.numel() == x.shape[-1] and tuple(w.shape) in ctx.gemv:
        return ops.gemv(x, w, b)
    return F.linear(x, w, b)


def project(x: torch.Tensor, layer: nn.Module, ctx: AttnContext | None) -> torch.Tensor:
    """``x`` times a projection layer: a plain one's weight through `linear` (the GEMV choice), a
    quantized one by its own product."""
    if isinstance(layer, nn.Linear):
        return linear(x, layer.weight, layer.bias, ctx)
    return layer(x)


def project_joined(x: torch.Tensor, fused: torch.Tensor | nn.Module | None, bias: torch.Tensor | None,
                   parts: list[nn.Module], ctx: AttnContext | None) -> torch.Tensor:
    """``x`` times the projections ``parts`` side by side (q/k/v, gate/up): one product where
    the build fused their weights (``fused``, ``bias``), else their products joined (an int4
    scheme's layers cannot be one view: a copy of the step's rows, so the fused path still runs)."""
    if fused is not None:
        return linear(x, fused, bias, ctx)
    return torch.cat([project(x, p, ctx) for p in parts], dim=-1)


def matmul_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_add: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """A decode step's attention as batched matmuls: q [B, H, (1,) Dh]; k/v: [B, Hkv, L, Dh]
    strided views of the cache (no copy); mask_add: [B*Hkv, G, L] additive 0/-inf, built once
    per step. Returns [B*Hkv, G, Dh] (head h = j * G + g). The matmuls read K/V once without
    repeating kv heads (SDPA with a mask and GQA may fall back to the math path), and baddbmm
    folds scale + mask into the QK^T kernel."""
    B, n_kv, L, Dh = k.shape
    qg = q.reshape(B * n_kv, -1, Dh)
    k3 = k.reshape(B * n_kv, L, Dh)  # a view: slot and head dims merge
    v3 = v.reshape(B * n_kv, L, Dh)
    scores = torch.baddbmm(mask_add, qg, k3.transpose(1, 2), alpha=scale)  # [B*Hkv, G, L]
    probs = torch.softmax(scores, dim=-1)  # accumulates in fp32 inside, one kernel
    return torch.bmm(probs, v3)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's rotate-half convention. x: [B, S, heads, Dh].

    rotate_half(x) * sin == swap_halves(x) * [-sin | sin]: 3 kernels instead of 5 (cat,
    unlike roll, reads a strided x without first making it contiguous).
    """
    h = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., h:], x[..., :h]), dim=-1), sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_rep = cfg.n_rep
        self.window = cfg.layer_windows[layer_idx]
        self.scale = cfg.head_dim**-0.5
        D, Dq, Dkv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(D, Dq, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, Dkv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, Dkv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(Dq, D, bias=cfg.o_bias)
        # [Dq + 2*Dkv, D] view over q/k/v when the loader placed them back to back
        # (the packer does): one matmul instead of three, no copy (see fuse_projections);
        # for quantized projections, a layer over such views (deployments.model.quant)
        self.qkv_w: torch.Tensor | nn.Module | None = None
        self.qkv_b: torch.Tensor | None = None

    def _sdpa(self, q, k, v, mask) -> torch.Tensor:
        # q: [B, H, S, Dh], k/v: [B, Hkv, L, Dh], mask: [B|1, 1, S, L] bool or None (causal, L == S)
        if self.n_rep > 1 and not _SDPA_GQA:
            k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        kw = {"enable_gqa": True} if self.n_rep > 1 and _SDPA_GQA else {}
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)

    def _decode_attn(self, q, k, v, mask_add) -> torch.Tensor:
        return matmul_decode_attention(q, k, v, mask_add, self.scale).view(q.shape[0], self.n_heads, 1, self.head_dim)

    def _qkv(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """q, k and v of ``x`` side by side, [..., (H + 2 Hkv) Dh]."""
        return project_joined(x, self.qkv_w, self.qkv_b, [self.q_proj, self.k_proj, self.v_proj], ctx)

    def _decode_fused(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        # one Triton kernel ropes q and k and writes k, v into the cache (8 torch kernels otherwise)
        B, H, Dh = x.shape[0], self.n_heads, self.head_dim
        qkv = self._qkv(x.view(B, -1), ctx)  # [B, (H + 2 Hkv) Dh]
        cache = ctx.cache
        kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
        table = {"block_table": cache.block_table} if cache.paged else {}  # rows read and write through it
        q = ops.rope_store_kv(qkv, ctx.cos.view(B, Dh), ctx.sin.view(B, Dh), kc, vc, ctx.positions,
                              H, self.n_kv, Dh, **table)  # [B, H, Dh]
        if ctx.attention_kernel:  # flash-decoding: key slices in parallel, masks from the positions
            read = ctx.positions if ctx.read_positions is None else ctx.read_positions
            out = ops.decode_attention(q, kc, vc, read, ctx.kv_len, self.window or 0, self.scale, **table)
        else:
            mask = ctx.masks.get(self.window) if ctx.masks else None
            k, v = self._cached(ctx, B)
            out = self._decode_attn(q.view(B, H, 1, Dh), k, v, mask)
        return project(out.view(B, 1, H * Dh), self.o_proj, ctx)

    def _prefill_fused(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """A prefill into a paged cache on the Triton path: rope_store_kv ropes q and k of every
        token and writes k and v through the table (one kernel for the five torch ones of the
        rotary embedding and the cache's writes, a fifth of a 2048-token prefill's device time);
        the attention reads the chunk's keys back from the cache, with any prefix before it."""
        B, S, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv, self.head_dim
        cache, at = ctx.cache, ctx.paged_index
        if "tokens" not in at:  # (one set for every layer of the forward)
            rows = ctx.prefill_slots(x.device)
            at.update(rows=rows, read=cache.table_rows(rows, ctx.start + S),
                      # token row r (prompt r // S) writes through its prompt's row of the table
                      tokens=cache.block_table[rows].repeat_interleave(S, 0),
                      positions=torch.arange(ctx.start, ctx.start + S, device=x.device).repeat(B),
                      cos=ctx.cos.reshape(B * S, Dh), sin=ctx.sin.reshape(B * S, Dh))
        kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
        qkv = self._qkv(x, ctx).view(B * S, -1)
        q = ops.rope_store_kv(qkv, at["cos"], at["sin"], kc, vc, at["positions"], H, Hkv, Dh,
                              block_table=at["tokens"])  # [B * S, H, Dh]
        k, v = cache.read(self.layer_idx, at["rows"], ctx.start + S, blocks=at["read"])
        mask = ctx.masks.get(self.window) if ctx.masks else None
        out = self._sdpa(q.view(B, S, H, Dh).transpose(1, 2), k, v, mask)  # [B, H, S, Dh]
        return project(out.transpose(1, 2).reshape(B, S, H * Dh), self.o_proj, ctx)

    def _cached(self, ctx: AttnContext, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's keys and values 0..kv_len-1 of cache slots 0..B-1: views of a static
        cache, a gather through a paged one's table."""
        cache, i = ctx.cache, self.layer_idx
        if cache.paged:
            at = ctx.paged_index
            if "read" not in at:  # (one gather index for every layer)
                at["slots"] = torch.arange(B, device=ctx.positions.device)
                at["read"] = cache.table_rows(at["slots"], ctx.kv_len)
            return cache.read(i, at["slots"], ctx.kv_len, blocks=at["read"])
        return cache.k[i][:B, :, : ctx.kv_len], cache.v[i][:B, :, : ctx.kv_len]

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        # x: [B, S, D]
        B, S, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv, self.head_dim
        if ctx.fused:
            if ctx.mode == "decode":
                return self._decode_fused(x, ctx)
            if ctx.mode == "prefill" and ctx.cache.paged:
                return self._prefill_fused(x, ctx)
        cos, sin = ctx.cos.unsqueeze(2), ctx.sin.unsqueeze(2)  # [B, S, 1, Dh]; sin sign-folded
        if self.qkv_w is not None:
            qkv = linear(x, self.qkv_w, self.qkv_b, None)  # [B, S, (H + 2 Hkv) Dh]
            # q and k lie side by side: rotate both heads' sets in one pass
            qk = _rope(qkv[..., : (H + Hkv) * Dh].view(B, S, H + Hkv, Dh), cos, sin)
            q, k = qk[:, :, :H], qk[:, :, H:]
            v = qkv[..., (H + Hkv) * Dh :].view(B, S, Hkv, Dh)
        else:
            q = _rope(self.q_proj(x).view(B, S, H, Dh), cos, sin)
            k = _rope(self.k_proj(x).view(B, S, Hkv, Dh), cos, sin)
            v = self.v_proj(x).view(B, S, Hkv, Dh)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, Dh] views
        mask = ctx.masks.get(self.window) if ctx.masks else None
        if ctx.mode == "nocache":
            out = self._sdpa(q, k, v, mask)
        elif ctx.cache.paged:
            out = self._paged(q, k, v, mask, ctx)
        elif ctx.mode == "prefill":  # one prompt's chunk into slot, or several prompts' (row b into slots[b])
            rows = ctx.slots if ctx.slots is not None else slice(ctx.slot, ctx.slot + 1)
            kc, vc = ctx.cache.k[self.layer_idx], ctx.cache.v[self.layer_idx]
            end = ctx.start + S
            kc[rows, :, ctx.start : end] = k
            vc[rows, :, ctx.start : end] = v
            if ctx.start == 0:  # fresh: causal over itself (mask: sliding windows; flash-eligible without)
                out = self._sdpa(q, k, v, mask)
            else:  # later chunk: attend to the cached prefix too
                out = self._sdpa(q, kc[rows, :, :end], vc[rows, :, :end], mask)
        else:  # decode: row i of the batch is cache slot i
            kc, vc = ctx.cache.k[self.layer_idx], ctx.cache.v[self.layer_idx]
            kc[ctx.rows, :, ctx.positions] = k[:, :, 0]  # [B, Hkv, Dh] written at each row's position
            vc[ctx.rows, :, ctx.positions] = v[:, :, 0]
            out = self._decode_attn(q, kc[:B, :, : ctx.kv_len], vc[:B, :, : ctx.kv_len], mask)
        out = out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)  # [B, S, H*Dh]
        return self.o_proj(out)

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, ctx: AttnContext
               ) -> torch.Tensor:
        """The cache modes of ``forward`` over a paged cache: keys and values written through the
        block table; a fresh prompt attends to its own, a later chunk and a decode step to what
        the cache holds (gathered). q, k, v: [B, heads, S, Dh]."""
        cache, i = ctx.cache, self.layer_idx
        B, S, dev = q.shape[0], q.shape[2], q.device
        at = ctx.paged_index
        if ctx.mode == "prefill":  # one prompt's chunk into slot, or several prompts' (row b into slots[b])
            if not at:
                rows = ctx.prefill_slots(dev)
                positions = torch.arange(ctx.start, ctx.start + S, device=dev).expand(B, S)
                at.update(rows=rows, write=cache.locate(rows, positions),
                          read=cache.table_rows(rows, ctx.start + S) if ctx.start else None)
            cache.write(i, at["rows"], None, k, v, at=at["write"])
            if ctx.start == 0:
                return self._sdpa(q, k, v, mask)
            kc, vc = cache.read(i, at["rows"], ctx.start + S, blocks=at["read"])  # the cached prefix too
            return self._sdpa(q, kc, vc, mask)
        # decode: row b of the batch is cache slot b
        if "write" not in at:
            at["write"] = cache.locate(ctx.rows, ctx.positions.view(B, 1))
        cache.write(i, ctx.rows, None, k, v, at=at["write"])
        kc, vc = self._cached(ctx, B)
        return self._decode_attn(q, kc, vc, mask)


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends the model's attention may use on ``device`` (above: not cuDNN's)."""
    if device.type == "cuda" and _SDPA_BACKENDS:
        return sdpa_kernel(_SDPA_BACKENDS)
    return contextlib.nullcontext()
