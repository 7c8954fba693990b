"""What every quantization scheme's class provides, and the linear layer that holds a scheme's
tensors (vLLM's ``model_executor/layers/quantization`` pattern: one small class per scheme says
which tensors a layer holds and which kernel runs it; the decoder's files do not change per
scheme).

A `QuantLinear` stands where the decoder has an ``nn.Linear``: its parameters are named as the
checkpoint's tensors (``q_proj.weight`` + ``q_proj.weight_scale``, ``q_proj.qweight`` + ...),
so the build assigns them as it assigns any other tensor, as views of the loader's one buffer
(nothing is dequantized ahead: no second copy of the weights)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deployments.kernels import quant as quant_kernels
from deployments.kernels.quant import WeightSpec
from weights.quant import QuantScheme


class QuantMethod:
    """One scheme's layers: the tensors each holds (`tensors`), its weight as a plain matrix
    (`dequantize`, the reference every kernel is tested against) and its product (`apply`)."""

    marker = "weight_scale"  # the tensor whose presence beside a projection says it is quantized
    optional: tuple[str, ...] = ()  # tensors a checkpoint may leave out
    # bytes per weight element that `dequantize` holds at once at most (its fp32 / int32 intermediates)
    dequant_bytes = 8

    def __init__(self, scheme: QuantScheme):
        self.scheme = scheme
        self.kernels = quant_kernels.QuantKernels()  # set by the build (kernels.quant.choose)

    def tensors(self, out_features: int, in_features: int
                ) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        """Each tensor of a layer [out_features, in_features]: name -> (shape, allowed dtypes)."""
        raise NotImplementedError

    def spec(self, layer: "QuantLinear") -> WeightSpec:
        """The layer's stored tensors as the kernels read them."""
        raise NotImplementedError

    def dequantize(self, layer: "QuantLinear", dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight [out_features, in_features] in ``dtype`` (computed in fp32)."""
        return quant_kernels.dequantize(self.spec(layer), dtype)

    def apply(self, layer: "QuantLinear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] with the kernel ``self.kernels`` names for
        this many rows: the weight-only kernel for a decode step's, fp8 tensor cores past
        ``WO_SMALL_ROWS`` where they passed their test;
        else dequantize, then matmul: a transient copy of one layer's weight, never kept (made in
        one Triton pass where the kernels passed their test; on the CPU, or where they failed, by
        the torch reference)."""
        rows = x.numel() // x.shape[-1]
        if self.kernels.scaled_mm and rows > quant_kernels.WO_SMALL_ROWS:
            return quant_kernels.fp8_scaled_mm(x, self.spec(layer), bias)
        if self.kernels.weight_only and rows <= quant_kernels.WO_MAX_ROWS:
            return quant_kernels.wo_matmul(x, self.spec(layer), bias)
        if self.kernels.weight_only:
            return F.linear(x, quant_kernels.dequantize_kernel(self.spec(layer), x.dtype), bias)
        return F.linear(x, self.dequantize(layer, x.dtype), bias)

    def fuse(self, layers: list["QuantLinear"], weight: torch.Tensor | None) -> "QuantLinear | None":
        """One layer computing ``layers`` (same inputs) stacked by output rows, over ``weight`` (their
        ``weight`` tensors as one view, None where they are not back to back) and a copy of their
        scales (small, as fused biases are copied); None where the scheme cannot (int4 words pack
        the outputs of an input row together: a fused layer would need a copy of the weights)."""
        return None

    def refresh_fused(self, fused: "QuantLinear") -> int:
        """Copy again, in place, what `fuse` copied out of the parts (their weights' bytes arrived
        after the build); how many tensors."""
        return 0

    def check(self, layer: "QuantLinear", name: str) -> None:
        """Refuse a layer whose tensors have a dtype the scheme does not read (ValueError naming the tensor)."""
        for t, (_, dtypes) in self.tensors(layer.out_features, layer.in_features).items():
            p = getattr(layer, t, None)
            if p is not None and p.dtype not in dtypes:
                want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise ValueError(f"tensor {name}.{t} is {str(p.dtype).removeprefix('torch.')}; "
                                 f"{self.scheme.describe()} stores it as {want}: re-export the checkpoint")


class QuantLinear(nn.Module):
    """A projection whose weight is stored quantized; ``method`` runs it."""

    def __init__(self, method: QuantMethod, in_features: int, out_features: int, bias: bool,
                 optional: tuple[str, ...] = ()):
        super().__init__()
        self.method, self.in_features, self.out_features = method, in_features, out_features
        for name, (shape, dtypes) in method.tensors(out_features, in_features).items():
            if name not in optional:
                self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtypes[0]), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.method.scheme.describe()}"


def quantized_projections(model: Any, method: QuantMethod, tensors: dict[str, Any]) -> int:
    """Replace each of the model's projections whose checkpoint holds ``method.marker`` beside it
    by a `QuantLinear` (on the model's device, meta in a build); a projection the checkpoint
    stores plainly (a scheme's ignore list) stays an ``nn.Linear``. Returns how many."""
    n = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or f"{name}.{method.marker}" not in tensors:
            continue
        optional = tuple(t for t in method.optional if f"{name}.{t}" not in tensors)
        q = QuantLinear(method, mod.in_features, mod.out_features, mod.bias is not None, optional)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, q)
        n += 1
    return n


def quant_layers(model: Any) -> list[tuple[str, QuantLinear]]:
    """The model's quantized layers by name: its projections', and the fused ones its layers hold
    outside the module tree (``deployments.model.fused``)."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            out.append((name, mod))
        for attr in ("qkv_w", "gate_up_w"):
            fused = mod.__dict__.get(attr)
            if isinstance(fused, QuantLinear):
                out.append((f"{name}.{attr}", fused))
    return out


def kernel_specs(model: Any) -> dict[str, WeightSpec]:
    """One quantized layer of each distinct shape, by its name: what ``kernels.quant.choose`` tests."""
    out: dict[tuple, tuple[str, WeightSpec]] = {}
    for name, mod in quant_layers(model):
        spec = mod.method.spec(mod)
        out.setdefault((spec.scheme, spec.n, spec.k, spec.g_idx is not None), (name, spec))
    return dict(out.values())
