"""Building the serving model from a packed model's tensors: no copy of the weights.

``build_model`` picks the native decoder (``llama.Transformer``) for the architectures it
computes exactly (``config.is_native``) and transformers' own class otherwise
(``hf_fallback``). The native one is built on the meta device and the given tensors are
*assigned*, so its parameters stay views into the loader's one device buffer; q/k/v and
gate/up are fused into one matrix each where the packer laid them back to back (a view, no
copy); the decode kernels are chosen by ``deployments.kernels.policy``.

Tensor parallelism: ``build_model(config, tensors, tp=group)`` builds the model of this process's
rank in the torch.distributed process group ``group`` from that rank's tensors (``weights.load(DEST,
rank=K)`` of a ``coldstart pack --tp N`` pack): the same build at the rank's sizes
(``weights.tp.rank_config``), with the group's collectives (``deployments.model.tp``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from deployments.kernels import policy
from deployments.kernels import quant as quant_kernels
from deployments.model.config import (NATIVE_ARCHITECTURES, SILU_ACTIVATIONS, ModelConfig, architecture,
                                      native_blockers, unread_fields)
from deployments.model.fused import fuse_projections
from deployments.model.llama import Transformer
from deployments.model.quant import QuantLinear, kernel_specs, method_for, quant_layers, quantized_projections

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


def gemv_groups(model: Transformer) -> dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """The model's batch-1 projections by weight shape, named after their roles (qkv, o_proj,
    gate_up, down_proj, lm_head), each with its (weight, bias) in every layer: what
    ``kernels.policy.gemv_choice`` times. Weights with strided rows are left out."""
    groups: dict[tuple[int, int], dict] = {}

    def add(name: str, w: Any, b: torch.Tensor | None) -> None:
        # (a quantized layer, fused or not, is no matrix: its scheme's kernels run it)
        if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dtype.itemsize > 1 and w.stride(1) == 1:
            g = groups.setdefault(tuple(w.shape), {"names": [], "pairs": []})
            if name not in g["names"]:
                g["names"].append(name)
            g["pairs"].append((w, b))
    for la in model.model.layers:
        at, mlp = la.self_attn, la.mlp
        add("qkv", at.qkv_w, at.qkv_b)
        add("o_proj", _plain(at.o_proj), at.o_proj.bias)
        add("gate_up", mlp.gate_up_w, mlp.gate_up_b)
        add("down_proj", _plain(mlp.down_proj), mlp.down_proj.bias)
    add("lm_head", model.lm_head.weight, None)
    return {"+".join(g["names"]): g["pairs"] for g in groups.values()}


def _plain(layer: nn.Module) -> torch.Tensor | None:
    """A projection's weight where it is a plain matrix (None for a quantized layer's)."""
    return layer.weight if isinstance(layer, nn.Linear) else None


def _expected_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def _quant_tensor(model: Transformer, name: str) -> bool:
    """Whether tensor ``name`` belongs to a quantized projection (its dtypes are the scheme's)."""
    mod_name = name.rpartition(".")[0]
    try:
        return isinstance(model.get_submodule(mod_name), QuantLinear)
    except AttributeError:
        return False


def build_native(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, rope_len: int | None = None,
                 tp: ProcessGroup | None = None) -> Transformer:
    """Build the native decoder on meta and assign `tensors` (HF names) as its parameters.

    ``tp``: a torch.distributed process group of more than one rank: `tensors` are this process's
    rank's slices (``weights.tp``) and the model is that rank's, with the group's collectives
    (``deployments.model.tp``); None or a group of one: the whole model, no collectives.

    Raises ValueError listing missing, unexpected and mis-shaped tensors.
    """
    t_start = time.perf_counter()
    parallel = None
    if tp is not None:
        from deployments.model.tp import tensor_parallel  # torch.distributed: only on this path
        from weights.tp import rank_config

        parallel = tensor_parallel(config, tp)
    cfg = ModelConfig.from_hf(config if parallel is None else rank_config(config, parallel.size))
    given = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}  # old HF checkpoints
    method = method_for(cfg.quantization) if cfg.quantization else None
    with torch.device("meta"):
        model = Transformer(cfg)
        n_quant = quantized_projections(model, method, given) if method else 0
    if method:
        log.info("%s: %d of %d projections quantized", cfg.quantization.describe(), n_quant,
                 7 * cfg.num_hidden_layers)
    expected = _expected_shapes(model)
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(k for k in expected if k not in given and k not in optional)
    unexpected = sorted(k for k in given if k not in expected)
    misshaped = sorted(
        f"{k}: expected {list(expected[k])}, given {list(given[k].shape)}"
        for k in expected
        if k in given and tuple(given[k].shape) != expected[k]
    )
    if missing or unexpected or misshaped:
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                parts.append(f"{title} ({len(items)}): " + "; ".join(shown))
        whose = "config.json" if parallel is None else (
            f"rank {parallel.rank} of {parallel.size}'s slice of config.json (load that rank's part: "
            f"weights.load(DEST, rank={parallel.rank}))")
        raise ValueError(f"{cfg.architecture} weights do not match {whose}: " + " | ".join(parts))
    devices = {t.device for t in given.values()}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    dtypes = {t.dtype for k, t in given.items() if not _quant_tensor(model, k)}
    if len(dtypes) > 1:
        log.warning("checkpoint mixes dtypes %s; the model computes in the embedding's dtype", sorted(map(str, dtypes)))
    # Assign, never copy: each parameter becomes the given tensor (a view of the loader's buffer).
    for name in expected:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        mod_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(mod_name), leaf, nn.Parameter(given[name], requires_grad=False))
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            mod.method.check(mod, name)
    if cfg.tie_word_embeddings:  # HF ties even when lm_head.weight is stored
        model.lm_head.weight = model.model.embed_tokens.weight
    model.tp = parallel
    fused = fuse_projections(model)
    log.info("fused projections: %d of %d (zero-copy views)", fused, 2 * cfg.num_hidden_layers)
    model.build_s["assemble"] = time.perf_counter() - t_start
    c = model.config
    model.kernels = policy.choose((c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                                   c.head_dim), model.dtype, model.device, lambda: gemv_groups(model),
                                  one_dtype=all(t.dtype == model.dtype for n, t in model.named_parameters()
                                                if not _quant_tensor(model, n)))
    model.build_s.update(model.kernels.seconds)
    if method:
        # the dequantize-then-matmul path's copy of one layer: its fp32 intermediates and the result
        widest = max(m.in_features * m.out_features for _, m in quant_layers(model))
        model.transient_weight_bytes = widest * (method.dequant_bytes + model.dtype.itemsize)
        method.kernels = quant_kernels.choose(kernel_specs(model), model.dtype, model.device)
        model.build_s.update(method.kernels.seconds)
        log.info("quantized layers: %s", method.kernels.describe())
    if cfg.hidden_act not in SILU_ACTIVATIONS:
        log.info("hidden_act=%r: the MLP computes it with torch kernels (the fused SwiGLU kernel is SiLU only)",
                 cfg.hidden_act)
    log.info("decode kernels: %s", model.kernels.describe())
    model.eval()
    model.setup_rope(rope_len or min(cfg.max_position_embeddings, 4096))
    return model


def build_model(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, tp: Any = None) -> nn.Module:
    """Build the serving model for `config` (an HF config.json dict) from `tensors` (HF names).

    ``tp``: a torch.distributed process group of the model's ranks: `tensors` are this process's
    rank's (``weights.load(DEST, rank=K)``) and the model is that rank's (native decoders only;
    see ``build_native``).

    Llama / Mistral / Qwen2 get the native decoder, unless a field asks for math it does not
    do (`native_blockers`, listed in deployments.model.config's docstring); those configs and
    any other `architectures[0]` are served through transformers' own class (slower start,
    one warning naming the reasons). Fields that transformers' class ignores too get one
    warning of their own (`unread_fields`).

    Example:
        model = build_model(json.load(open(d / "config.json")), safetensors.torch.load_file(f, device="cuda"))
    """
    arch = architecture(config)
    unread = unread_fields(config)
    if unread:
        log.warning("%s: config.json sets fields that transformers' %s does not read either, so they change "
                    "nothing here: %s", arch, arch, "; ".join(unread))
    why = native_blockers(config)
    if not why:
        return build_native(config, tensors, tp=tp)
    if tp is not None and _group_size(tp) > 1:
        raise ValueError(f"{arch}: tensor parallelism needs the native decoder, and this config is not served "
                         f"natively ({'; '.join(why)}); serve it on one device")
    from deployments.model.hf_fallback import build_hf_model  # imports transformers: only on this path

    try:
        return build_hf_model(config, tensors, why="; ".join(why))
    except Exception as e:
        if arch not in NATIVE_ARCHITECTURES:
            raise
        raise ValueError(f"{arch}: not served natively ({'; '.join(why)}), and transformers could not build it "
                         f"either: {type(e).__name__}: {e}") from e


def _group_size(group: ProcessGroup) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)
