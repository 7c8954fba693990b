"""Every environment variable coldstart reads, in one place: name, type, default, what it does.

Read one with ``envs.read("COLDSTART_TRITON")``; code elsewhere never calls ``os.environ``
for these. ``docs/configuration.md`` lists them from ``VARS`` (``deployments.tools.reference``).
A value that does not parse is a ``ValueError`` naming the variable and what it takes, raised
where it is read (in a replica: its constructor or the worker setup hook's first step), never a
silent fallback. Imports nothing heavy: the worker setup hook reads these before torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(name: str, v: str) -> bool:
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"{name}={v!r}: give 1 or 0 (or true / false)")


def _text(name: str, v: str) -> str:
    return v.strip()


def _gigabytes(name: str, v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not x >= 0:
        raise ValueError(f"{name}={v!r}: give a size in GB (a number >= 0; 0 for no limit but the disk)")
    return x


def _seconds(name: str, v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = float("nan")
    if not x > 0 or x == float("inf"):
        raise ValueError(f"{name}={v!r}: give a number of seconds above 0")
    return x


def _bytes(name: str, v: str) -> int:
    s = v.strip()
    if not s.isdigit() or int(s) <= 0:
        raise ValueError(f"{name}={v!r}: give a whole number of bytes above 0")
    return int(s)


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    parse: Callable[[str, str], Any]
    doc: str
    kind: str  # what the value is, for the reference page


VARS: dict[str, Var] = {v.name: v for v in (
    Var("COLDSTART_HOME", "", _text, "Directory a relative `args.model` is taken from (default: where "
        "`serve run` was started).", "path"),
    Var("COLDSTART_TRITON", "1", _flag, "0 turns the Triton decode kernels off: every decode step runs "
        "torch's kernels (slower per token; nothing is compiled).", "0 / 1"),
    Var("COLDSTART_EARLY_IMPORT", "1", _text, "What the worker setup hook (`deployments.startup.early.hook`) "
        "imports beside Ray's start of the worker: 1 the engine's modules, 0 nothing, or a "
        "comma-separated list of modules.", "1 / 0 / list"),
    Var("COLDSTART_BYTECODE_CACHE", "", _text, "Where a replica keeps compiled Python modules when its "
        "interpreter keeps none (`PYTHONDONTWRITEBYTECODE=1` and packages without .pyc files): empty for "
        "`coldstart-bytecode/` beside Triton's kernel cache, 0 for nowhere, or a directory.", "path / 0"),
    Var("COLDSTART_PAUSE_GC", "1", _flag, "0 leaves Python's garbage collector on during a replica's start "
        "(by default it is paused from the setup hook until the replica is warm, then what the start made "
        "is frozen).", "0 / 1"),
    Var("COLDSTART_EARLY_WEIGHTS", "", _text, "A packed model directory (absolute) whose weights the worker "
        "setup hook starts reading into the page cache, one piece at a time, where they are mostly not there "
        "yet: on a new node the disk then works from Ray's first moments of the worker instead of from the "
        "replica's constructor, seconds later. `coldstart serve --model` and serve_config.gpu.yaml set it to "
        "`args.model`; empty: the constructor starts that read (`load.trickle`).", "path"),
    Var("COLDSTART_CACHE_DIR", "", _text, "Where a node keeps the remote packed models its replicas fetched "
        "(`args.model` an `s3://`, `gs://` or `https://` URI), each under the digest of its index, for the "
        "node's next replicas and its peers; empty for `~/.cache/coldstart/models`. Put it on local NVMe "
        "with room for the models.", "path"),
    Var("COLDSTART_CACHE_MAX_GB", "0", _gigabytes, "The node cache's size limit in GB: before a transfer, the "
        "least recently used models are removed until the new one fits; 0 for no limit but the disk.", "GB"),
    Var("COLDSTART_PROXY_BODY_TIMEOUT_S", "10", _seconds, "Read by Ray Serve's HTTP proxy where "
        "`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` is `deployments.server.proxy:middlewares`: seconds a "
        "request's whole body may take to arrive at the proxy, which routes a request to a replica only once "
        "its body is in; a client that has not sent it by then gets a 408 from the proxy and never reaches a "
        "replica. Set it where the proxy runs (serve_config.yaml's `controller_options.runtime_env`).",
        "seconds"),
    Var("COLDSTART_PROXY_MAX_BODY_BYTES", str(16 << 20), _bytes, "Read by the HTTP proxy as above: a larger "
        "request body gets a 413 from the proxy, unread (a replica refuses one beyond what its context could "
        "need on its own: `args.http`).", "bytes"),
    Var("CUDA_MODULE_LOADING", "LAZY", _text, "CUDA's own: LAZY (serve_config.yaml sets it, and torch's "
        "default) loads each kernel at its first use, so a context is made in ~0.4 s instead of seconds; a "
        "replica warns where it is anything else.", "LAZY / EAGER"),
    Var("TRITON_INTERPRET", "0", _flag, "Triton's own: 1 runs Triton kernels in its interpreter, on CPU "
        "tensors (the tests' way of running the decode kernels without a GPU).", "0 / 1"),
    Var("TRITON_HOME", "", _text, "Triton's own: its cache lives in `TRITON_HOME/.triton/cache` where "
        "TRITON_CACHE_DIR is unset (default: the home directory).", "path"),
    Var("TRITON_CACHE_DIR", "", _text, "Triton's own: where compiled kernels are kept (default "
        "`~/.triton/cache`). coldstart keeps its kernel verdicts and bytecode cache beside them; mount a "
        "volume here so that a new container finds them.", "path"),
)}


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of variable ``name`` (one of ``VARS``) in ``env`` (default ``os.environ``);
    its default where unset or empty. Raises ``ValueError`` naming the variable for a bad value."""
    var = VARS[name]
    raw = (os.environ if env is None else env).get(name, "")
    return var.parse(name, raw if raw.strip() else var.default)
