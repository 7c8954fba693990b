"""Pure-torch decoder for the Llama family (Llama 2/3/3.1, Mistral, Qwen2).

The model is built on the meta device and the given tensors are *assigned*
(never copied), so its parameters stay views into the loader's one device
buffer. Module names mirror the HF checkpoint names exactly, so the tensor
dict from `weights.load(...)` (or a safetensors file) maps 1:1 onto it.

Attention (``deployments.model.attention``) runs in one of three modes, chosen by an
`AttnContext` shared by all layers of one forward call:

- no cache  (tests, scoring): causal attention over the given tokens only;
- prefill   one sequence, one chunk of its prompt, written into its KV cache;
- decode    one token for each of the first B slots (the static cache's slots, or the paged
  cache's block tables). Static shapes (B, kv_len) so the engine can capture it as a CUDA graph.

A tensor-parallel rank (``Transformer.tp``, set by the build: ``deployments.model.tp``) is this
same decoder at its rank's sizes; ``tp`` joins the ranks' work after o_proj and down_proj, in the
embedding and in the head. With ``tp`` None (one device) those are plain checks that skip.

This module must stay cheap to import: no transformers, no ray, no jinja2.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from deployments.kernels import ops, policy
from deployments.kernels.policy import KernelPlan
from deployments.model.attention import Attention, AttnContext, attention_backends, linear, project, project_joined
from deployments.model.config import ACTIVATIONS, SILU_ACTIVATIONS, ModelConfig, rope_inv_freq
from deployments.model.fused import refresh_copies
from deployments.model.kv_cache import KVCache, PagedKVCache

if TYPE_CHECKING:
    from deployments.model.tp import TensorParallel

log = logging.getLogger(__name__)

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel (fp32 statistics inside) instead of HF's ~7 elementwise ones:
        # decode is bound by kernel count. HF rounds to the input dtype before the weight
        # multiply; this rounds once after it (<= 1 ulp apart in fp16/bf16, equal in fp32).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(D, F_, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(F_, D, bias=cfg.mlp_bias)
        self.gate_up_w: torch.Tensor | nn.Module | None = None  # [2F, D] view, as Attention.qkv_w
        self.gate_up_b: torch.Tensor | None = None
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.silu = cfg.hidden_act in SILU_ACTIVATIONS  # the fused kernel computes SiLU only

    def forward(self, x: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        if ctx is not None and ctx.fused:
            gate_up = project_joined(x, self.gate_up_w, self.gate_up_b, [self.gate_proj, self.up_proj], ctx)
            if self.silu:
                h = ops.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                h = self.act(gate) * up
            return project(h, self.down_proj, ctx)
        if self.gate_up_w is not None:
            gate, up = linear(x, self.gate_up_w, self.gate_up_b, None).chunk(2, dim=-1)  # [B, S, F] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttnContext, tp: TensorParallel | None = None) -> torch.Tensor:
        # tp: a tensor-parallel rank's TensorParallel: attention and MLP give partial sums
        a = self.self_attn(self.input_layernorm(x), ctx)
        x = x + (a if tp is None else tp.all_reduce(a))
        m = self.mlp(self.post_attention_layernorm(x))
        return x + (m if tp is None else tp.all_reduce(m))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # _weight skips reset_parameters: the real weights are assigned later, and
        # torch.nn.init.normal_ imports torch._dynamo and sympy (over a second of start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """The native decoder. Parameter names equal HF's (`model.layers.0.self_attn.q_proj.weight`, ...)."""

    supports_cuda_graphs = True
    supports_prefill_padding = True  # prefill(..., n_valid=)
    supports_batched_prefill = True  # prefill_batch

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_len = 0
        self.kernels = KernelPlan()  # the Triton kernels it runs on CUDA (set by the build: kernels.policy)
        self.tp: TensorParallel | None = None  # a tensor-parallel rank's collectives (set by the build)
        self.build_s: dict[str, float] = {}  # the build's steps, seconds (assemble, kernel tests, GEMV choice)
        # bytes a forward may allocate for one layer's weight beside its activations (set by the build: a
        # quantized layer that dequantizes, then multiplies; deployments.model.quant)
        self.transient_weight_bytes = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        """The logits' width: the whole vocabulary (a tensor-parallel rank's config has its slice's)."""
        return self.config.vocab_size if self.tp is None else self.tp.vocab_size

    def setup_rope(self, max_seq_len: int) -> None:
        """Precompute cos/sin tables [max_seq_len, head_dim] (fp32 math, HF order) for the
        model's device. Computed on the CPU and copied: on the GPU, each of the six torch
        kernels it takes would load its module on first use (tens of milliseconds each in a
        replica's start), for a table the CPU makes in a millisecond."""
        if self.rope_len == max_seq_len and self._cos.device == self.device:
            return
        inv = rope_inv_freq(self.config)
        t = torch.arange(max_seq_len, dtype=torch.float32)
        emb = torch.outer(t, inv)
        cos = torch.cat((emb, emb), dim=-1).cos().to(self.dtype)  # [T, Dh]
        sin = torch.cat((-emb.sin(), emb.sin()), dim=-1).to(self.dtype)  # sign folded for the half swap
        self._cos, self._sin = cos.to(self.device), sin.to(self.device)
        self.rope_len = max_seq_len

    def weights_loaded(self) -> None:
        """The weights' bytes have all arrived (a build over a buffer still loading): redo, in
        place, what the build copied out of them."""
        refresh_copies(self)

    supports_paged_cache = True

    def new_cache(self, max_slots: int, max_seq_len: int) -> KVCache:
        return KVCache(self.config, max_slots, max_seq_len, self.dtype, self.device)

    def cache_bytes(self, max_slots: int, max_seq_len: int) -> int:
        return KVCache.bytes_needed(self.config, max_slots, max_seq_len, self.dtype)

    def new_paged_cache(self, num_blocks: int, block_size: int, max_slots: int, max_seq_len: int) -> PagedKVCache:
        return PagedKVCache(self.config, num_blocks, block_size, max_slots, max_seq_len, self.dtype, self.device)

    def cache_block_bytes(self, block_size: int) -> int:
        return PagedKVCache.bytes_per_block(self.config, block_size, self.dtype)

    def activation_bytes(self, tokens: int, logit_rows: int, gathered: int) -> int:
        """An upper estimate of what one prefill forward allocates beside the weights and the
        cache: ``tokens`` rows through a layer (the residual, its norm, q/k/v, the attention's
        output and the MLP's gate, up and product), ``gathered`` cached positions' keys and values
        read back for its attention (a chunk past a prefix), and the head's ``logit_rows`` logits
        (with their fp32 copy for sampling), and ``transient_weight_bytes``. Layers run one after
        another, so one layer's worth."""
        c, size = self.config, self.dtype.itemsize
        kv = c.num_key_value_heads * c.head_dim
        per_token = 4 * c.hidden_size + c.num_attention_heads * c.head_dim + 2 * kv + 3 * c.intermediate_size
        return ((tokens * per_token + gathered * 2 * kv) * size + logit_rows * c.vocab_size * (size + 4)
                + self.transient_weight_bytes)

    def check_paged_kernels(self, cache: PagedKVCache) -> float:
        """Keep the decode kernels whose paged variants pass their test at ``cache``'s geometry
        (``kernels.policy.paged_check``: once per node); its seconds."""
        c = self.config
        self.kernels = policy.paged_check((c.num_attention_heads, c.num_key_value_heads, c.head_dim), cache.block_size,
                                          cache.blocks_per_seq, self.dtype, self.device, self.kernels)
        return self.kernels.seconds.get("paged_kernel_test", 0.0)

    def _masks(self, q_pos: torch.Tensor, L: int, valid: torch.Tensor | None = None) -> dict:
        # q_pos: [B, S] absolute positions; returns window -> [B, 1, S, L] (True = attend)
        k_pos = torch.arange(L, device=q_pos.device)
        qp = q_pos.unsqueeze(-1)  # [B, S, 1]
        out = {}
        for w in set(self.config.layer_windows):
            m = k_pos <= qp
            if w is not None:
                m = m & (k_pos > qp - w)
            if valid is not None:  # padding rows attend everywhere so they stay finite
                m = m | ~valid.view(-1, 1, 1)
            out[w] = m.unsqueeze(1)
        return out

    def _run(self, tokens: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        with attention_backends(tokens.device):
            return self._layers(tokens, ctx)

    def _layers(self, tokens: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        tp = self.tp
        if tp is None:
            x = self.model.embed_tokens(tokens)  # [B, S, D]
        else:
            x = tp.embed(tokens, self.model.embed_tokens.weight)
        if not self.kernels.fused:
            for layer in self.model.layers:
                x = layer(x, ctx, tp)
            return self.model.norm(x)
        # Triton path: each residual add is fused into the RMSNorm that follows it
        ctx.fused, ctx.gemv = True, self.kernels.gemv  # (decode() sets ctx.attention_kernel)
        layers, eps = self.model.layers, self.config.rms_norm_eps
        h, res = layers[0].input_layernorm(x), x
        for i, layer in enumerate(layers):
            a = layer.self_attn(h, ctx)
            if tp is not None:
                tp.all_reduce(a)
            h, res = ops.add_rms_norm(a, res, layer.post_attention_layernorm.weight, eps)
            m = layer.mlp(h, ctx)
            if tp is not None:
                tp.all_reduce(m)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, res = ops.add_rms_norm(m, res, nxt.weight, eps)
        return h

    def attention_kernel(self) -> bool:
        """Whether the decode steps use the Triton attention: every step, where it passed its
        self-test and the fused path runs (bench/kernel_sweep.py: faster than the batched
        matmuls at every batch size and length measured, with grouped-query heads or without,
        and more so where a batch's rows differ in length, since each reads its keys only up
        to its own position)."""
        return self.kernels.attention and self.kernels.fused

    def decode_kv_lens(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """The key-length bounds (of the engine's ``buckets``, ascending) that need a CUDA graph
        each: the Triton attention reads each row's keys up to the row's own position whatever
        the bound, so the longest serves every step; the batched matmuls read up to the bound,
        so each bucket saves reading."""
        return buckets[-1:] if self.attention_kernel() else buckets

    def _head(self, h: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        """Logits of the final hidden states ``h`` [..., D] -> [..., vocab_size] (ctx: a decode
        step's, for its GEMV choice); a tensor-parallel rank's gathered from every rank."""
        logits = linear(h, self.lm_head.weight, None, ctx)
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def _check_len(self, n: int) -> None:
        if n > self.rope_len:
            raise ValueError(f"sequence of {n} positions exceeds the rope table ({self.rope_len}); call setup_rope")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full causal forward without a cache. tokens: [B, S] -> logits [B, S, V]."""
        B, S = tokens.shape
        self._check_len(S)
        ctx = AttnContext("nocache", self._cos[:S].expand(B, S, -1), self._sin[:S].expand(B, S, -1), {})
        if any(w is not None for w in self.config.layer_windows):
            pos = torch.arange(S, device=tokens.device).expand(B, S)
            ctx.masks = self._masks(pos, S)
        return self._head(self._run(tokens, ctx))

    def prefill(self, tokens: torch.Tensor, cache: KVCache, slot: int, start: int,
                n_valid: int | None = None) -> torch.Tensor:
        """One prompt chunk of one sequence. tokens: [1, C] at positions start..start+C-1.

        Writes its keys/values into `slot` of the cache; returns the logits [V] of the last
        position, or of position ``n_valid - 1`` when the chunk is padded after its first
        ``n_valid`` tokens (causal attention: padding changes nothing before it, and its
        cache entries are written again by the decode steps that reach them).
        """
        C = tokens.shape[1]
        end = start + C
        self._check_len(end)
        pos = torch.arange(start, end, device=tokens.device).unsqueeze(0)  # [1, C]
        ctx = AttnContext("prefill", self._cos[start:end][None], self._sin[start:end][None], {}, cache, slot, start)
        if start > 0 or any(w is not None for w in self.config.layer_windows):
            ctx.masks = self._masks(pos, end)
        h = self._run(tokens, ctx)
        return self._head(h[0, (n_valid or C) - 1])

    def prefill_batch(self, tokens: torch.Tensor, cache: KVCache, slots: list[int], n_valid: list[int],
                      logit_rows: int | None = None, start: int = 0) -> torch.Tensor:
        """Several prompts' chunks in one forward: row b of tokens [B, C] holds the next
        ``n_valid[b]`` tokens of the prompt in cache slot ``slots[b]`` (padded after them), at
        positions start..start+C-1; every row's cache holds its positions before ``start``
        already (a shared prefix; none for fresh prompts). Returns the logits [B, V] of each row's
        last valid position, the same as B calls of ``prefill``. The head multiplies
        ``logit_rows`` (>= B) rows, padded with row 0, so that its matrix product has one shape
        whatever B is (a new shape costs its first run in a request's time)."""
        B, C = tokens.shape
        if len(slots) != B or len(n_valid) != B or not all(0 < n <= C for n in n_valid):
            raise ValueError(f"prefill_batch: {B} rows of {C} tokens need {B} slots and 1..{C} valid "
                             f"tokens each, got slots={slots}, n_valid={n_valid}")
        if len(set(slots)) != B:
            raise ValueError(f"prefill_batch: each row needs its own cache slot, got {slots}")
        end = start + C
        self._check_len(end)
        dev = tokens.device
        ctx = AttnContext("prefill", self._cos[start:end].expand(B, C, -1), self._sin[start:end].expand(B, C, -1),
                          {}, cache, start=start, slots=torch.tensor(slots, device=dev))
        if start > 0 or any(w is not None for w in self.config.layer_windows):
            ctx.masks = self._masks(torch.arange(start, end, device=dev).expand(B, C), end)
        h = self._run(tokens, ctx)  # [B, C, D]
        rows = max(B, logit_rows or B)
        take = torch.tensor([n - 1 for n in n_valid] + [n_valid[0] - 1] * (rows - B), device=dev)
        src = torch.tensor(list(range(B)) + [0] * (rows - B), device=dev)
        return self._head(h[src, take])[:B]

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: KVCache, kv_len: int
    ) -> torch.Tensor:
        """One decode step for cache slots 0..B-1. tokens/positions/valid: [B] -> logits [B, V].

        Rows whose valid is False (or 0) are padding: they write their (harmless) keys at
        their given position, which the engine sets to one no live sequence has
        reached yet, and the Triton attention reads one key for them (their output is
        dropped; from their position they would read the whole cache, and a batch's slowest
        rows set its step's time). Static shapes for a fixed (B, kv_len): CUDA-graph capturable.
        """
        B = tokens.shape[0]
        cfg = self.config
        pos2 = positions.view(B, 1)
        masks = {}
        attention_kernel = self.attention_kernel()
        # the Triton attention takes its masks from the positions: build none when every layer
        # uses it (nor the comparisons they take: each torch kernel's first use in a process
        # loads its module, tens of milliseconds of a replica's start)
        if not attention_kernel:
            for w, m in self._masks(pos2, kv_len, valid != 0).items():  # m: [B, 1, 1, L] bool
                add = torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(~m, float("-inf"))
                masks[w] = add.expand(B, cfg.num_key_value_heads, cfg.n_rep, kv_len).reshape(-1, cfg.n_rep, kv_len)
        ctx = AttnContext(
            "decode",
            self._cos[pos2],  # [B, 1, Dh]
            self._sin[pos2],
            masks,
            cache,
            positions=positions,
            # the torch path's (the Triton attention runs only on the fused path: no second walk of the layers)
            rows=None if self.kernels.fused else torch.arange(B, device=tokens.device),
            kv_len=kv_len,
            attention_kernel=attention_kernel,
            read_positions=positions * (valid != 0) if attention_kernel else None,
        )
        h = self._run(tokens.view(B, 1), ctx)
        return self._head(h[:, 0], ctx)
