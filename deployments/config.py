"""The application's configuration: its ``args`` and its ``user_config``, as typed models.

serve_config.yaml's ``args`` are a ``DeploymentArgs`` (the model, the device, and the engine's,
the load's and the HTTP front's options), checked in ``deployments.app.build_app`` on Serve's
controller before any replica starts: an unknown field or a wrong type fails ``serve run`` at
once with the field's name. ``user_config`` is a ``UserConfig`` (the warm-up plan), checked by
``coldstart serve`` before Ray starts and by each replica's ``reconfigure``. Every field is
documented once, under it; ``docs/configuration.md`` is generated from these models
(``python -m deployments.tools.reference``). No torch is imported here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments import envs
from deployments.engine.config import EngineConfig
from deployments.engine.warmup import WarmupPlan
from weights.options import LoadOptions

M = TypeVar("M", bound=BaseModel)

_STRICT = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class HttpOptions(BaseModel):
    """The HTTP front's limits (``args.http``)."""

    model_config = _STRICT

    body_timeout_s: float = Field(10.0, gt=0)
    """Seconds a request's whole body may take to arrive at the replica; a client that has not sent
    it by then gets a 408 and frees the replica's request slot (keep it below the deployment's
    graceful_shutdown_timeout_s, so a stalled client never holds up a scale-down). Behind Ray's
    proxy with ``deployments.server.proxy`` (serve_config.yaml's controller_options), the proxy
    holds a request until its body is in (COLDSTART_PROXY_BODY_TIMEOUT_S) and this never runs out."""


class DeploymentArgs(BaseModel):
    """The application's ``args`` in serve_config.yaml."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str = Field("weights/demo", strict=True)
    """Packed model directory; a relative path is taken from COLDSTART_HOME, else from the
    directory `serve run` was started in. Or a packed model in object storage or on an HTTP
    server (`s3://bucket/path`, `gs://...`, `https://...`, put there by `coldstart push`): each
    node fetches it once, from its peers where they hold it, into its cache (COLDSTART_CACHE_DIR)."""
    model_name: str | None = Field(None, strict=True)
    """Model id in the OpenAI API (default: the directory's name)."""
    device: str = Field("auto", strict=True)
    """auto (cuda when the replica sees a GPU, else cpu), cpu, cuda or cuda:N."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The engine's options (``EngineConfig``)."""
    load: LoadOptions = Field(default_factory=LoadOptions)
    """The weight load's options (``LoadOptions``)."""
    http: HttpOptions = Field(default_factory=HttpOptions)
    """The HTTP front's limits (``HttpOptions``)."""
    tp: int = Field(1, ge=1, strict=True)
    """Tensor-parallel ranks: the model is a split pack (`coldstart pack SRC DEST --tp N`) served by
    one replica over N devices of one node (N bundles of one GPU each, STRICT_PACK; the replica is
    rank 0, the others are Ray actors in its placement group)."""
    fault_injection: bool = Field(False, strict=True)
    """Enable POST /admin/fault for drills (stops the engine loop, so health checks fail)."""

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        from weights.remote import check_uri, is_remote
        return check_uri(v) if is_remote(v) else v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda") and not (v.startswith("cuda:") and v[5:].isdigit()):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_device_each(self) -> "DeploymentArgs":
        if self.tp > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"tp: each of the {self.tp} ranks uses the GPU Ray gives it; set device to auto or "
                             f"cuda, not {self.device}")
        return self

    def bundles(self) -> list[dict[str, float]]:
        """The placement group a replica of ``tp`` > 1 ranks needs: one bundle per rank (one GPU each
        unless the device is cpu); the replica's own actor takes bundle 0."""
        one = {"CPU": 1.0} if self.device == "cpu" else {"CPU": 1.0, "GPU": 1.0}
        return [dict(one) for _ in range(self.tp)]

    def is_remote(self) -> bool:
        """Whether ``model`` is a URI (object storage, HTTP), not a directory on the node."""
        from weights.remote import is_remote
        return is_remote(self.model)

    def model_label(self) -> str:
        """The model's id in the API: ``model_name``, else the directory's (or URI path's) last name."""
        if self.model_name:
            return self.model_name
        from weights.remote import model_name
        return model_name(self.model) if self.is_remote() else self.model_path().name

    def model_path(self) -> Path:
        if self.is_remote():
            raise ValueError(f"{self.model} is remote: it has a path only on a node that fetched it")
        p = Path(self.model).expanduser()
        if not p.is_absolute():
            p = Path(envs.read("COLDSTART_HOME") or os.getcwd()) / p
        return p


class UserConfig(BaseModel):
    """The deployment's ``user_config``: what ``reconfigure`` applies to a running replica."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    warmup: WarmupPlan = Field(default_factory=WarmupPlan)
    """The warm-up plan (``WarmupPlan``); editing it re-warms the replicas."""


_KIND = {"int_type": "int", "float_type": "a number", "bool_type": "true or false", "string_type": "str",
         "list_type": "a list", "tuple_type": "a list", "dict_type": "an object", "model_type": "an object",
         "model_attributes_type": "an object"}


def _model_at(cls: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (a path of field names below ``cls``)."""
    for name in loc:
        field = cls.model_fields.get(str(name))
        sub = getattr(field, "annotation", None)
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return None
        cls = sub
    return cls


def describe(e: ValidationError, where: str, cls: type[BaseModel] | None = None) -> str:
    """``e``'s errors in the project's words, each naming the field from ``where`` down, what
    it must be and what was given; an unknown field's message lists the known ones of ``cls``
    (or of its model that holds it)."""
    lines = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(x) for x in (where, *err["loc"]) if x != "")
        kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
        shown = f"{type(given).__name__} {given!r}"[:200]
        if kind == "extra_forbidden":
            parent, _, name = loc.rpartition(".")
            holder = _model_at(cls, err["loc"][:-1]) if cls is not None else None
            known = f"; known: {', '.join(sorted(holder.model_fields))}" if holder is not None else ""
            lines.append(f"{parent}: unknown field {name!r}{known}")
        elif kind == "missing":
            lines.append(f"{loc} is required")
        elif kind in _KIND:
            lines.append(f"{loc} must be {_KIND[kind]}, got {shown}")
        elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
            bound = next(iter(ctx.values()), "?")
            lines.append(f"{loc} must be {op} {bound}, got {given!r}")
        elif kind == "value_error":
            lines.append(f"{loc}: {str(ctx.get('error', err['msg']))}")
        else:
            lines.append(f"{loc}: {err['msg']} (got {shown})")
    return "; ".join(lines)


def parse(cls: type[M], data: Mapping[str, Any] | None, where: str) -> M:
    """``cls`` built from ``data`` (what serve_config.yaml holds); ValueError in the project's
    words (``describe``), listing the known fields where one is unknown."""
    try:
        return cls.model_validate(dict(data or {}) if isinstance(data, Mapping) or data is None else data)
    except ValidationError as e:
        raise ValueError(f"{describe(e, where, cls)} (docs/configuration.md lists every field)") from None
