"""Quantized projections: one small class per scheme (fp8.py, awq.py, gptq.py) says which
tensors a layer holds and which kernel runs it (``base``); `method_for` picks the class of a
``weights.quant.QuantScheme``."""

from __future__ import annotations

from deployments.model.quant.awq import AwqMethod
from deployments.model.quant.base import QuantLinear, QuantMethod, kernel_specs, quant_layers, quantized_projections
from deployments.model.quant.fp8 import Fp8Method
from deployments.model.quant.gptq import GptqMethod
from weights.quant import QuantScheme

_METHODS: dict[str, type[QuantMethod]] = {"fp8": Fp8Method, "awq": AwqMethod, "gptq": GptqMethod}


def method_for(scheme: QuantScheme) -> QuantMethod:
    """The class that runs ``scheme``'s layers."""
    return _METHODS[scheme.method](scheme)


__all__ = ["QuantLinear", "QuantMethod", "kernel_specs", "method_for", "quant_layers", "quantized_projections"]
