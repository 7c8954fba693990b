"""Quantized checkpoints: which scheme a ``config.json``'s ``quantization_config`` names
(`scheme_of`) and the tensors each scheme stores beside a projection; imports no torch (the
reference quantisers that make such tensors: ``weights.quantize``).

A packed file keeps a quantized checkpoint's tensors exactly as the source stores them (the
packer never casts them, `keeps_dtype`), each 4 KiB-aligned like any other tensor, so the chunk
checksums and ``coldstart verify`` cover weights, scales and zero points alike; the index's
``metadata["quantization"]`` records the scheme (`QuantScheme.to_json`). The source layouts,
per projection of ``out_features`` N and ``in_features`` K (torch's ``nn.Linear`` weight is
[N, K])::

  fp8, compressed-tensors "float-quantized" (strategy "channel" or "tensor"), fbgemm_fp8:
      weight          float8_e4m3fn [N, K]
      weight_scale    float32/bf16/fp16 [N, 1] (channel; fbgemm: always) or [1] / [] (tensor)
      input_scale     (static activation scale, optional; unread: activations stay unquantized)
      W = weight * weight_scale
  fp8 block-wise (quant_method "fp8", weight_block_size [bn, bk], e.g. 128 x 128):
      weight          float8_e4m3fn [N, K]
      weight_scale_inv float32 [ceil(N / bn), ceil(K / bk)]
      W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]
  awq (version "gemm", 4 bits, zero points), group size G along K:
      qweight  int32 [K, N / 8]    eight 4-bit columns per word, nibble i holding column
                                   8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]
      qzeros   int32 [K / G, N / 8] packed as qweight
      scales   fp16  [K / G, N]
      W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]
  gptq (4 bits; desc_act / act-order or not; sym or not), group size G along K:
      qweight  int32 [K / 8, N]    eight 4-bit rows per word, nibble i holding row 8 r + i
      qzeros   int32 [K / G, N / 8] nibble i holding column 8 c + i; checkpoint_format "gptq"
                                   stores zero - 1 (sym: 7 for 8), "gptq_v2" the zero itself
      scales   fp16  [K / G, N]
      g_idx    int32 [K]           the group of each input row (act-order: any order; absent:
                                   k // G)
      W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

# Tensors of a quantized projection other than its weight: stored as the source has them, never cast.
QUANT_PARAMS = ("weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point",
                "qweight", "qzeros", "scales", "g_idx")
# The projections a Llama-family layer holds: what a scheme may quantize (never the embedding, norms or head).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0  # the largest float8_e4m3fn
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8 c + AWQ_ORDER[i]


@dataclass(frozen=True)
class QuantScheme:
    """A quantized checkpoint's scheme, read from its ``quantization_config``.

    Attributes:
        method: "fp8", "awq" or "gptq": the decoder's class that runs it.
        source: the config's ``quant_method`` (compressed-tensors, fbgemm_fp8, fp8, awq, gptq).
        strategy: fp8: "channel", "tensor" or "block"; awq / gptq: "group".
        bits: weight bits (8 or 4).
        group_size: awq / gptq: input rows per group (-1: all of them).
        block: fp8 block-wise: the [rows, columns] of a scale's block.
        zero_point: awq / gptq: asymmetric, with stored zero points.
        act_order: gptq ``desc_act``: groups follow ``g_idx``, not the row order.
        zero_offset: gptq: what the stored zero points lack (1 for checkpoint_format "gptq").
    """

    method: str
    source: str
    strategy: str
    bits: int
    group_size: int = 0
    block: tuple[int, int] | None = None
    zero_point: bool = False
    act_order: bool = False
    zero_offset: int = 0

    def to_json(self) -> dict:
        """The index's ``metadata["quantization"]``."""
        d = asdict(self)
        d["block"] = list(self.block) if self.block else None
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "QuantScheme":
        """The inverse of `to_json` (a packed file's ``metadata["quantization"]``)."""
        return cls(**{**d, "block": tuple(d["block"]) if d.get("block") else None})

    def describe(self) -> str:
        if self.method == "fp8":
            what = f"{self.block[0]}x{self.block[1]} blocks" if self.block else f"per-{self.strategy} scales"
            return f"{self.source} fp8 ({what})"
        sym = "asymmetric" if self.zero_point else "symmetric"
        order = ", act-order" if self.act_order else ""
        return f"{self.source} int{self.bits} (group {self.group_size}, {sym}{order})"


def _field(q: Mapping[str, Any], key: str, want: Any, default: Any = None) -> Any:
    v = q.get(key, default)
    if want is not None and v not in want:
        raise ValueError(f"config.json: quantization_config.{key}={v!r} (quant_method={q.get('quant_method')!r}) "
                         f"is not supported; supported: {', '.join(map(repr, want))}")
    return v


def scheme_of(config: Mapping[str, Any]) -> QuantScheme | None:
    """The scheme of a config.json dict (None: not quantized). ValueError naming the field for a
    scheme or an option this project does not read."""
    q = config.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"config.json: quantization_config is a {type(q).__name__}, not an object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fbgemm_fp8":
        return QuantScheme("fp8", method, "channel", 8)
    if method == "fp8":
        _field(q, "fmt", ("e4m3",), "e4m3")
        block = q.get("weight_block_size")
        if block is None:  # a per-tensor fp8 checkpoint of this kind stores weight_scale as compressed-tensors'
            return QuantScheme("fp8", method, "tensor", 8)
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                            for b in block)):
            raise ValueError(f"config.json: quantization_config.weight_block_size={block!r} is not two positive "
                             "ints [rows, columns]")
        return QuantScheme("fp8", method, "block", 8, block=(block[0], block[1]))
    if method == "awq":
        _field(q, "bits", (4,), q.get("w_bit", 4))
        _field(q, "version", ("gemm", "GEMM"), "gemm")
        _field(q, "zero_point", (True,), True)
        return QuantScheme("awq", method, "group", 4, group_size=_group(q, q.get("group_size", q.get("q_group_size"))),
                           zero_point=True)
    if method == "gptq":
        _field(q, "bits", (4,), 4)
        fmt = _field(q, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
        return QuantScheme("gptq", method, "group", 4, group_size=_group(q, q.get("group_size", 128)),
                           zero_point=not q.get("sym", True), act_order=bool(q.get("desc_act", False)),
                           zero_offset=1 if fmt == "gptq" else 0)
    raise ValueError(f"config.json: quantization_config.quant_method={method!r} is not supported; supported: "
                     "compressed-tensors (float-quantized), fbgemm_fp8, fp8, awq, gptq")


def _group(q: Mapping[str, Any], g: Any) -> int:
    if not isinstance(g, int) or isinstance(g, bool) or not (g == -1 or g > 0 and g % 8 == 0):
        raise ValueError(f"config.json: quantization_config.group_size={g!r} (quant_method="
                         f"{q.get('quant_method')!r}) must be -1 or a positive multiple of 8")
    return g


def _compressed_tensors(q: Mapping[str, Any]) -> QuantScheme:
    _field(q, "format", ("float-quantized", "naive-quantized"), q.get("format"))
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"config.json: quantization_config.config_groups has {len(groups)} groups "
                         f"({', '.join(groups) or 'none'}); one group of fp8 weights is supported")
    (gname, g), = groups.items()
    w = g.get("weights") or {}
    where = f"quantization_config.config_groups.{gname}.weights"
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise ValueError(f"config.json: {where} is num_bits={w.get('num_bits')!r}, type={w.get('type')!r}; "
                         "supported: fp8 (num_bits 8, type float)")
    if w.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"config.json: {where}.strategy={w.get('strategy')!r} is not supported; supported: "
                         "'channel', 'tensor'")
    if not w.get("symmetric", True) or w.get("dynamic", False):
        raise ValueError(f"config.json: {where} is symmetric={w.get('symmetric')!r}, dynamic={w.get('dynamic')!r}; "
                         "supported: symmetric static fp8 weights")
    return QuantScheme("fp8", "compressed-tensors", w["strategy"], 8)


def keeps_dtype(name: str) -> bool:
    """Whether a tensor holds quantization data that a pack's --dtype must not cast."""
    return name.rsplit(".", 1)[-1] in QUANT_PARAMS


def is_projection_weight(name: str, shape: tuple[int, ...]) -> bool:
    """``model.layers.<i>.<module>.<proj>.weight`` of a 2-D projection: what ``--quantize`` quantizes."""
    parts = name.split(".")
    return (len(shape) == 2 and len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight"
            and parts[-2] in PROJECTIONS)


# --- `coldstart pack --quantize fp8` --------------------------------------------------------------------

QUANTIZE_CHOICES = ("fp8",)


def fp8_config(config: Mapping[str, Any]) -> dict:
    """``config`` with the quantization_config of a per-channel fp8 pack: compressed-tensors'
    float-quantized format (static per-channel weight scales; activations left unquantized), so
    the pack reads like a checkpoint quantized by llm-compressor."""
    return {**config, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}},
        "ignore": ["lm_head"]}}


def describe_packed(metadata: Mapping[str, Any]) -> str:
    """", <scheme>" for a packed file's index metadata that records a quantization, else ""."""
    q = metadata.get("quantization")
    return f", {QuantScheme.from_json(q).describe()}" if q else ""
