"""The model: its configuration (``config``), the native decoder for the Llama family (``llama``,
``kv_cache``), the transformers fallback for other architectures (``hf_fallback``), and how a
packed model's tensors become one of them without a copy (``build``)::

    from deployments.model import build_model
    model = build_model(loaded.config, loaded.tensors)

A tensor-parallel rank's model (``tp``: its process group; ``deployments.model.tp``)::

    loaded = weights.load(DEST, rank=torch.distributed.get_rank(group))
    model = build_model(loaded.config, loaded.tensors, tp=group)
"""

from deployments.model.build import build_model, build_native
from deployments.model.config import NATIVE_ARCHITECTURES, ModelConfig, architecture, is_native, native_blockers
from deployments.model.kv_cache import KVCache
from deployments.model.llama import Transformer

__all__ = ["KVCache", "ModelConfig", "NATIVE_ARCHITECTURES", "Transformer", "architecture", "build_model",
           "build_native", "is_native", "native_blockers"]
