"""The native decoder's configuration, read from an HF ``config.json``, its rotary
frequencies (with Llama 3 / linear / dynamic scaling), and the one decision of whether a
config is served natively (`native_blockers`, `is_native`). No nn.Module here.

Hidden-field audit: every config.json field that changes (or might be thought to change)
what transformers 5.24's LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM compute
(their modeling_/configuration_ files, modeling_rope_utils, masking_utils, cache_utils).
NATIVE: honoured natively. FALLBACK: `native_blockers` names it, build_model serves the model
through transformers, one warning. UNREAD: transformers' class ignores it too, so native
(one warning, `unread_fields`). REFUSED: from_hf raises. NO MATH: changes no logit.

  architectures, model_type       NATIVE for the three classes (model_type if no architectures); else FALLBACK
  vocab/hidden/intermediate_size  NATIVE (required; tensor shapes checked)
  num_hidden_layers, num_attention_heads
                                  NATIVE (required)
  num_key_value_heads             NATIVE (absent/null: num_attention_heads)
  head_dim                        NATIVE (absent/null: hidden_size // heads; Qwen2 reads it too)
  hidden_act                      NATIVE silu, swish, gelu, gelu_pytorch_tanh (fused SwiGLU kernel: SiLU only); else FALLBACK
  rms_norm_eps                    NATIVE (default 1e-6 in all three)
  tie_word_embeddings             NATIVE (lm_head.weight may be absent)
  attention_bias                  NATIVE Llama (q/k/v/o); UNREAD Mistral (none), Qwen2 (q/k/v always, o never)
  mlp_bias                        NATIVE Llama; UNREAD Mistral, Qwen2 (never)
  max_position_embeddings         NATIVE (defaults 2048 / 131072 / 32768)
  rope_theta                      NATIVE (the rope dict's wins over the top level; default 10000)
  rope_scaling, rope_parameters   NATIVE; rope_scaling wins when both are set, as in transformers
  rope_type / type                NATIVE default, linear, llama3, dynamic (= default below max_position_embeddings,
                                  which the engine never passes); yarn, longrope, mrope, any other: FALLBACK
  rope dict nested by layer type  FALLBACK (one rope for every layer natively)
  rope factor                     NATIVE linear, dynamic, llama3 (REFUSED when missing)
  rope low/high_freq_factor       NATIVE llama3 (defaults 1 and 4; transformers requires them)
  original_max_position_embeddings
                                  NATIVE llama3: top-level wins over the dict's, default max_position_embeddings
  rope attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate, short/long_factor
                                  yarn/longrope only (FALLBACK); in a native type's dict UNREAD
  rope mrope_section              UNREAD (these classes rotate text positions alike); rope_type mrope FALLBACK
  partial_rotary_factor           rope_type default: UNREAD (whole head rotated); other types: FALLBACK
  sliding_window                  NATIVE Mistral (absent: 4096, null: none), Qwen2 (with use_sliding_window;
                                  absent: 4096); UNREAD Llama (its forward ignores it; its DynamicCache does not)
  use_sliding_window              NATIVE Qwen2 (default false); UNREAD Llama, Mistral
  max_window_layers               NATIVE Qwen2 (default 28); UNREAD Llama, Mistral
  layer_types                     NATIVE Qwen2 (full_attention, attention, sliding_attention; else FALLBACK);
                                  UNREAD Llama, Mistral (Mistral windows every layer)
  is_causal                       false/null: FALLBACK (transformers attends both ways)
  attention_chunk_size            UNREAD by the forward (DynamicCache only, as Llama's sliding_window)
  attn_logit_softcapping, final_logit_softcapping, query_pre_attn_scalar
                                  UNREAD (Gemma's)
  attention/embedding/residual_multiplier, logits_scaling
                                  UNREAD (Granite's)
  logit_scale, scale_emb, scale_depth, dim_model_base, clip_qkv, qk_layernorm, use_qk_norm, no_rope_layers,
  hidden_activation               UNREAD (other classes')
  auto_map                        UNREAD (no repository code runs; transformers' own class is the reference)
  quantization_config             NATIVE fp8 (compressed-tensors float-quantized, fbgemm_fp8, block-wise fp8),
                                  awq (gemm), gptq (``weights.quant.scheme_of``; the layers: deployments.model.quant);
                                  any other scheme or option REFUSED naming the field; the fallback refuses them all
  pretraining_tp                  NO MATH (unread by transformers 5; older ones split the same matmuls)
  attention_dropout               NO MATH (eval; the fallback's model is in eval mode)
  torch_dtype / dtype             NO MATH (the tensors' dtype is the compute dtype)
  pad/bos/eos_token_id, use_cache, initializer_range, attn_implementation, output_hidden_states,
  chunk_size_feed_forward         NO MATH (padding_idx only matters in training; eager and sdpa agree)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from weights.quant import QuantScheme, scheme_of

NATIVE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_SUPPORTED_ROPE = ("default", "linear", "dynamic", "llama3")
# The rope keys each native rope type reads (transformers' init function for that type reads the same).
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "dynamic": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
}
# hidden_act -> the MLP's activation, as transformers' ACT2FN computes it (the same torch call)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
SILU_ACTIVATIONS = ("silu", "swish")  # what the fused Triton SwiGLU kernel (kernels.silu_mul) computes
_LAYER_TYPES = ("full_attention", "attention", "sliding_attention")  # "attention": transformers' legacy name
# Fields of other classes' math that transformers' Llama/Mistral/Qwen2 classes never read, with the value
# that would change nothing anyway (None: any value is worth a warning).
_FOREIGN_FIELDS: dict[str, Any] = {
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "query_pre_attn_scalar": None,
    "attention_multiplier": 1.0, "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
    "logit_scale": 1.0, "scale_emb": 1.0, "scale_depth": 1.0, "dim_model_base": None, "clip_qkv": None,
    "qk_layernorm": False, "use_qk_norm": False, "no_rope_layers": None, "hidden_activation": None,
    "attention_chunk_size": None, "auto_map": None,
}


def architecture(cfg: Mapping[str, Any]) -> str:
    """`architectures[0]`, or the native class for `model_type` when a config lacks it."""
    archs = cfg.get("architectures") or []
    return archs[0] if archs else _BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")


def _rope(cfg: Mapping[str, Any]) -> tuple[str, dict]:
    """(the key it came from, the rope dict transformers reads): `rope_scaling` wins over
    `rope_parameters` when both are set (transformers' convert_rope_params_to_dict)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(key)
    return key, dict(rope) if isinstance(rope, Mapping) else {}


def _rope_type(rope: Mapping[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default")) or "default"


def _partial_rotary(cfg: Mapping[str, Any], rope: Mapping[str, Any]) -> Any:
    return rope["partial_rotary_factor"] if "partial_rotary_factor" in rope else cfg.get("partial_rotary_factor")


def native_blockers(cfg: Mapping[str, Any]) -> list[str]:
    """Why the native decoder would not compute what transformers' class computes for this
    config.json (an empty list: it would). build_model serves a config with blockers through
    transformers and logs these reasons; ModelConfig.from_hf refuses it. The module
    docstring lists every field checked and its verdict."""
    arch = architecture(cfg)
    if arch not in NATIVE_ARCHITECTURES:
        return [(f"architectures={cfg.get('architectures')!r} (model_type={cfg.get('model_type')!r}) has no native "
                 f"implementation (native: {', '.join(NATIVE_ARCHITECTURES)})")]
    why = []
    act = cfg.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        why.append(f"hidden_act={act!r} (the native MLP computes {', '.join(ACTIVATIONS)} only)")
    key, rope = _rope(cfg)
    nested = sorted(k for k, v in rope.items() if isinstance(v, Mapping))
    if nested:
        why.append(f"{key} is nested by layer type ({', '.join(nested)}) (the native decoder has one rope for "
                   "every layer)")
    else:
        rope_type = _rope_type(rope)
        if rope_type not in _SUPPORTED_ROPE:
            why.append(f"{key}.rope_type={rope_type!r} (native rope types: {', '.join(_SUPPORTED_ROPE)})")
        elif rope_type != "default" and _partial_rotary(cfg, rope) not in (None, 1, 1.0):
            why.append(f"partial_rotary_factor={_partial_rotary(cfg, rope)!r} with rope_type {rope_type!r} (the "
                       "native decoder rotates the whole head_dim)")
    if "is_causal" in cfg and not cfg["is_causal"]:
        why.append(f"is_causal={cfg['is_causal']!r} (transformers then attends both ways; the native decoder is "
                   "causal)")
    if arch == "Qwen2ForCausalLM":
        odd = sorted({str(t) for t in (cfg.get("layer_types") or []) if t not in _LAYER_TYPES})
        if odd:
            why.append(f"layer_types has {', '.join(map(repr, odd))} (native: {', '.join(_LAYER_TYPES)})")
    return why


def is_native(cfg: Mapping[str, Any]) -> bool:
    """Whether build_model serves this config.json with the native decoder."""
    return not native_blockers(cfg)


def unread_fields(cfg: Mapping[str, Any]) -> list[str]:
    """Fields set to a value that would change the math of another class, but that transformers'
    class for this architecture does not read either: both paths compute without them, and
    build_model says so in one warning. Empty for architectures without a native decoder."""
    arch = architecture(cfg)
    if arch not in NATIVE_ARCHITECTURES:
        return []
    out = [f"{k}={cfg[k]!r}" for k, neutral in _FOREIGN_FIELDS.items()
           if cfg.get(k) is not None and cfg.get(k) != neutral and cfg.get(k) != []]
    biases = {"MistralForCausalLM": "MistralForCausalLM has no biases",
              "Qwen2ForCausalLM": "Qwen2ForCausalLM has q/k/v biases always, o_proj and MLP biases never"}
    if arch in biases:
        out += [f"{k}={cfg[k]!r} ({biases[arch]})" for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
    if arch == "LlamaForCausalLM" and cfg.get("sliding_window") is not None:
        out.append(f"sliding_window={cfg['sliding_window']!r} (LlamaForCausalLM attends to every key; transformers' "
                   "DynamicCache would keep only that many, so its own cached decoding differs from its forward)")
    if arch != "Qwen2ForCausalLM":
        given = [f"{k}={cfg[k]!r}" for k in ("use_sliding_window", "max_window_layers", "layer_types")
                 if cfg.get(k) is not None]
        if given:
            out.append(", ".join(given) + f" (Qwen2's window fields; {arch} " + (
                "windows every layer by sliding_window alone)" if arch == "MistralForCausalLM"
                else "attends to every key)"))
    key, rope = _rope(cfg)
    if not any(isinstance(v, Mapping) for v in rope.values()):
        rope_type = _rope_type(rope)
        if rope_type in _ROPE_KEYS:
            extra = sorted(k for k in rope if k not in _ROPE_KEYS[rope_type] and k != "partial_rotary_factor")
            if extra:
                given = ", ".join(f"{k}={rope[k]!r}" for k in extra)
                out.append(f"{key} {given} (not read by rope_type {rope_type!r})")
        prf = _partial_rotary(cfg, rope)
        if rope_type == "default" and prf not in (None, 1, 1.0):
            out.append(f"partial_rotary_factor={prf!r} (the default rope rotates the whole head_dim)")
    return out


def _need(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json: missing required field `{key}`")
    return cfg[key]


@dataclass
class ModelConfig:
    """Everything the native decoder needs, read from an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0  # 0 -> num_attention_heads (no GQA)
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"linear"|"dynamic", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias
    mlp_bias: bool = False
    hidden_act: str = "silu"  # a key of ACTIVATIONS
    # Per layer: sliding-window size or None (full attention). Mistral: all layers;
    # Qwen2: layers >= max_window_layers when use_sliding_window.
    layer_windows: list = field(default_factory=list)
    quantization: QuantScheme | None = None  # the projections' scheme (deployments.model.quant); None: plain
    # derived
    n_rep: int = field(init=False)
    rope_type: str = field(init=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"config `{name}` must be a positive int, got {v!r}")
        if not self.num_key_value_heads:
            self.num_key_value_heads = self.num_attention_heads
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"config `hidden_size` ({self.hidden_size}) is not divisible by "
                    f"`num_attention_heads` ({self.num_attention_heads}); give `head_dim`"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"config `head_dim` must be even for rotary embeddings, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config `num_key_value_heads` ({self.num_key_value_heads}) must divide "
                f"`num_attention_heads` ({self.num_attention_heads})"
            )
        self.n_rep = self.num_attention_heads // self.num_key_value_heads
        rs = self.rope_scaling or {}
        self.rope_type = rs.get("rope_type", rs.get("type", "default")) or "default"
        if self.rope_type not in _SUPPORTED_ROPE:
            raise ValueError(
                f"config `rope_scaling.rope_type` {self.rope_type!r} is not supported natively "
                f"(supported: {', '.join(_SUPPORTED_ROPE)})"
            )
        if self.rope_type in ("linear", "dynamic", "llama3") and "factor" not in rs:
            raise ValueError(f"config `rope_scaling.factor` is required for rope_type {self.rope_type!r}")
        if rs.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config `partial_rotary_factor` != 1.0 is not supported natively")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"config `hidden_act` {self.hidden_act!r} is not supported natively "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_hidden_layers
        if len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(
                f"config `layer_types` has {len(self.layer_windows)} entries, expected num_hidden_layers="
                f"{self.num_hidden_layers}"
            )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Read an HF config.json dict (old `rope_scaling` or new `rope_parameters` style) as
        transformers' class for it does. Strict: a config with `native_blockers` (which
        build_model serves through transformers instead) raises ValueError naming them."""
        why = native_blockers(cfg)
        if why:
            raise ValueError("config.json cannot be served by the native decoder: " + "; ".join(why)
                             + " (deployments.model.build_model serves it through transformers)")
        quant = scheme_of(cfg)  # ValueError naming the field of a scheme not read here
        arch = architecture(cfg)
        n_layers = _need(cfg, "num_hidden_layers")
        defaults = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Qwen2ForCausalLM": 32768}
        max_pos = int(cfg.get("max_position_embeddings") or defaults[arch])
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older `rope_scaling`.
        _, rope = _rope(cfg)
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        rope.pop("partial_rotary_factor", None)  # unread by the default rope; a blocker with the others
        if _rope_type(rope) == "default":
            rope = {}
        elif _rope_type(rope) == "llama3":  # as transformers: the top-level value wins, then the dict's
            rope["original_max_position_embeddings"] = (cfg.get("original_max_position_embeddings")
                                                        or rope.get("original_max_position_embeddings") or max_pos)
        llama = arch == "LlamaForCausalLM"  # Mistral has no biases; Qwen2 q/k/v biases only, whatever the fields say
        bias = llama and bool(cfg.get("attention_bias", False))
        windows: list = [None] * n_layers
        if arch == "MistralForCausalLM" and cfg.get("sliding_window", 4096):  # MistralConfig's default: 4096
            windows = [int(cfg.get("sliding_window", 4096))] * n_layers
        if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window") and cfg.get("sliding_window", 4096):
            types = cfg.get("layer_types") or [
                "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                for i in range(n_layers)
            ]
            windows = [int(cfg.get("sliding_window", 4096)) if t == "sliding_attention" else None for t in types]
        return cls(
            architecture=arch,
            vocab_size=_need(cfg, "vocab_size"),
            hidden_size=_need(cfg, "hidden_size"),
            intermediate_size=_need(cfg, "intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=_need(cfg, "num_attention_heads"),
            num_key_value_heads=cfg.get("num_key_value_heads") or 0,
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bias or arch == "Qwen2ForCausalLM",
            o_bias=bias,
            mlp_bias=llama and bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_act") or "silu",
            layer_windows=windows,
            quantization=quant,
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with HF's scaling rules.

    "dynamic" NTK only changes anything past max_position_embeddings, which the
    engine never reaches (max_seq_len <= max_position_embeddings), so it equals
    "default" here.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling or {}
    if cfg.rope_type == "linear":
        inv = inv / rs["factor"]
    elif cfg.rope_type == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)  # transformers' default
        lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wl) & ~(wavelen > lo_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv
