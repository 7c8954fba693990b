"""The native decoder's configuration, read from an HF ``config.json``, and its rotary
frequencies (with Llama 3 / linear / dynamic scaling). No nn.Module here."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

NATIVE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture(cfg: Mapping[str, Any]) -> str:
    """`architectures[0]`, or the native class for `model_type` when a config lacks it."""
    archs = cfg.get("architectures") or []
    return archs[0] if archs else _BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")
_SUPPORTED_ROPE = ("default", "linear", "dynamic", "llama3")
# hidden_act -> the MLP's activation, as transformers' ACT2FN computes it (the same torch call)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
SILU_ACTIVATIONS = ("silu", "swish")  # what the fused Triton SwiGLU kernel (kernels.silu_mul) computes


def _rope(cfg: Mapping[str, Any]) -> tuple[str, dict]:
    """(the key it came from, the rope dict transformers reads): `rope_scaling` wins over
    `rope_parameters` when both are set (transformers' convert_rope_params_to_dict)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(key)
    return key, dict(rope) if isinstance(rope, Mapping) else {}


def _rope_type(rope: Mapping[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default")) or "default"


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
        transformers' class for it does."""
        arch = architecture(cfg)
        if arch not in NATIVE_ARCHITECTURES:
            raise ValueError(
                f"config `architectures` {cfg.get('architectures')!r} has no native implementation "
                f"(native: {', '.join(NATIVE_ARCHITECTURES)}); use hf_fallback"
            )
        n_layers = _need(cfg, "num_hidden_layers")
        defaults = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Qwen2ForCausalLM": 32768}
        max_pos = int(cfg.get("max_position_embeddings") or defaults[arch])
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older `rope_scaling`.
        _, rope = _rope(cfg)
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
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
