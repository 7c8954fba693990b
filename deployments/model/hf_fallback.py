"""Serve an architecture without a native implementation through transformers.

Slower to start (transformers' model classes take seconds to import) and
slower to decode (eager, one sequence per forward, no CUDA graphs), but any
`*ForCausalLM` that transformers knows still serves. transformers is imported
only inside `build_hf_model`, never at module import.

The wrapper exposes the same model interface the engine uses for the native
decoder: `new_cache`, `cache_bytes`, `prefill`, `decode`, `max_position_embeddings`,
`dtype`, `device`, `vocab_size` (the logits' width), `supports_cuda_graphs`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Create parameters on meta but buffers on the CPU.

    Non-persistent buffers (rotary inv_freq, causal-mask tables) are not in a
    checkpoint; building under `torch.device("meta")` would leave them empty.
    Same trick as accelerate's `init_empty_weights(include_buffers=False)`.
    """
    orig = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        orig(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


@dataclass
class _Cfg:
    vocab_size: int
    max_position_embeddings: int
    architecture: str


class HFCache:
    """One transformers cache object per slot (grows dynamically; no static preallocation)."""

    paged = False

    def __init__(self, max_slots: int, max_seq_len: int):
        self.slots: list[Any] = [None] * max_slots
        self.max_slots, self.max_seq_len = max_slots, max_seq_len

    def zero_slot(self, slot: int, upto: int) -> None:
        """The engine frees a slot: its cache object goes (the next prefill makes a new one)."""
        self.slots[slot] = None


_NOT_PAGED = "a transformers model has no paged KV cache (supports_paged_cache is False)"


class HFModel(nn.Module):
    """Engine-facing wrapper around a transformers causal LM (``deployments.engine.decoder.Decoder``):
    eager, one sequence per forward, a static cache of transformers' own objects."""

    supports_cuda_graphs = False
    supports_paged_cache = False
    supports_prefill_padding = False
    supports_batched_prefill = False

    def __init__(self, hf: nn.Module, config: Mapping[str, Any]):
        super().__init__()
        self.hf = hf
        n_pos = (
            config.get("max_position_embeddings") or config.get("n_positions") or config.get("max_seq_len") or 2048
        )
        self.config = _Cfg(int(config["vocab_size"]), int(n_pos), (config.get("architectures") or ["?"])[0])
        self.max_position_embeddings = self.config.max_position_embeddings
        self.vocab_size = self.config.vocab_size
        self.build_s: dict[str, float] = {}  # (transformers' build has no steps of its own to time)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def new_cache(self, max_slots: int, max_seq_len: int) -> HFCache:
        return HFCache(max_slots, max_seq_len)

    def cache_bytes(self, max_slots: int, max_seq_len: int) -> int:
        return 0  # allocated on demand by transformers

    def setup_rope(self, max_seq_len: int) -> None:  # transformers handles positions itself
        pass

    def weights_loaded(self) -> None:  # built after its load: the weights are there already
        pass

    def activation_bytes(self, tokens: int, logit_rows: int, gathered: int) -> None:
        return None  # no estimate: the engine's fixed reserve

    def decode_kv_lens(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        return buckets  # (no graphs: the bounds only pad the decode step's inputs)

    def new_paged_cache(self, num_blocks: int, block_size: int, max_slots: int, max_seq_len: int) -> Any:
        raise NotImplementedError(_NOT_PAGED)

    def cache_block_bytes(self, block_size: int) -> int:
        raise NotImplementedError(_NOT_PAGED)

    def check_paged_kernels(self, cache: Any) -> float:
        raise NotImplementedError(_NOT_PAGED)

    def prefill_batch(self, tokens: torch.Tensor, cache: HFCache, slots: list[int], n_valid: list[int],
                      **kw: Any) -> torch.Tensor:
        raise NotImplementedError("a transformers model prefills one prompt at a time "
                                  "(supports_batched_prefill is False)")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    def prefill(self, tokens: torch.Tensor, cache: HFCache, slot: int, start: int) -> torch.Tensor:
        # tokens: [1, C] -> logits [V]
        past = cache.slots[slot] if start > 0 else None
        out = self.hf(input_ids=tokens, past_key_values=past, use_cache=True)
        cache.slots[slot] = out.past_key_values
        return out.logits[0, -1]

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: HFCache, kv_len: int
    ) -> torch.Tensor:
        # tokens/positions/valid: [B] -> logits [B, V]; one forward per live row (caches differ in length)
        B = tokens.shape[0]
        logits = torch.zeros(B, self.config.vocab_size, device=tokens.device, dtype=self.dtype)
        for i in torch.nonzero(valid).flatten().tolist():
            out = self.hf(input_ids=tokens[i].view(1, 1), past_key_values=cache.slots[i], use_cache=True)
            cache.slots[i] = out.past_key_values
            logits[i] = out.logits[0, -1]
        return logits


def build_hf_model(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, reference: bool = False,
                   why: str | None = None) -> HFModel:
    """Build transformers' class for `config["architectures"][0]` and assign `tensors` (no copy).

    reference=True only changes the log line (benchmarks build it on purpose); `why` is the
    reason the native decoder does not serve it, for that line (build_model passes
    deployments.model.config.native_blockers').
    Raises ValueError listing missing checkpoint tensors, and for a quantized checkpoint (it
    would build the bare class and multiply packed integers as if they were weights).
    """
    arch = (config.get("architectures") or ["?"])[0]
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise ValueError(f"{arch}: config.json's quantization_config (quant_method={method!r}) cannot be served "
                         "through transformers here (the fallback builds the bare class and does not dequantize); "
                         "quantized checkpoints are served by the native decoder only (Llama, Mistral, Qwen2), or "
                         "pack an fp16/bf16 copy of this model")
    t0 = time.perf_counter()
    if reference:
        log.info("building transformers' %s as a reference", arch)
    else:
        log.warning("serving %s through transformers (slower start and decode): %s", arch,
                    why or f"no native implementation for {arch}")
    import transformers  # noqa: PLC0415 - deliberately lazy, costs seconds

    cfg_dict = dict(config)
    model_type = cfg_dict.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"config.json: missing field `model_type`, needed to build {arch} through transformers")
    hf_config = transformers.AutoConfig.for_model(model_type, **cfg_dict)
    cls = getattr(transformers, arch, None) if arch != "?" else None
    if arch != "?" and cls is None:
        raise ValueError(f"config `architectures` {arch!r} is unknown to transformers {transformers.__version__}")
    first = next(iter(tensors.values()))
    with _params_on_meta():
        hf = cls(hf_config) if cls is not None else transformers.AutoModelForCausalLM.from_config(hf_config)
    # Tied parameters (e.g. lm_head -> wte) may be stored under only one name.
    missing, unexpected = hf.load_state_dict(dict(tensors), strict=False, assign=True)
    hf.tie_weights()
    still_meta = [n for n, p in hf.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"{arch}: checkpoint lacks tensors {sorted(still_meta)[:20]} (missing: {len(still_meta)})")
    if unexpected:
        log.warning("%s: ignoring %d unexpected tensors, e.g. %s", arch, len(unexpected), unexpected[:5])
    for name, buf in list(hf.named_buffers()):  # non-persistent buffers were built on the CPU
        if buf.device != first.device:
            mod_name, _, leaf = name.rpartition(".")
            mod = hf.get_submodule(mod_name) if mod_name else hf
            mod._buffers[leaf] = buf.to(first.device)
    hf.eval().requires_grad_(False)
    log.info("built %s through transformers in %.2f s", arch, time.perf_counter() - t0)
    return HFModel(hf, config)
