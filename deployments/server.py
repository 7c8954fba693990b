"""The serving logic as a plain class: start-up, warm-up, health, HTTP.

``LLMServer`` has the shape Ray Serve expects, but needs no Ray: tests and
tools build it directly. ``deployments.app`` adds the deployment options.

Start-up order (each step timed; phases go to the log and the metrics):
  1. imports: torch and the engine modules (never transformers for native models)
  2. preflight checks, the device and its CUDA context
  3. load: the packed model into one device buffer and its tensor views, then the
     bytes, verified as they arrive, on the loader's threads with the read-ahead
     of the file beside them (a cold disk starts now); meanwhile
  4. engine: model over views of that buffer, kernels' self-tests, tokenizer,
     KV cache, CUDA graphs (shapes and addresses only; nothing reads a weight
     before the load has finished and its checksums matched)
Then ``reconfigure(user_config)`` runs the warm-up plan through the same path
as requests; only then does ``check_health`` pass, so Ray routes traffic to
warm replicas only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from typing import Any, AsyncIterator, Callable, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments import api
from deployments.config import DeploymentArgs, WarmupPlan, _from_dict
from deployments.metrics import Metrics
from weights.options import LoadOptions
from weights.readahead import is_cold, stop_trickle, trickle
from weights.timing import PhaseTimer

log = logging.getLogger("coldstart.server")

# Text is refused before tokenizing above this many characters per context token: natural
# text averages about four, so only a text made of a vocabulary's longest tokens could fit
# beyond it.
MAX_CHARS_PER_TOKEN = 64
# and a body is refused unread above 12 bytes per such character (JSON's longest spelling of
# one: a surrogate pair as two \u escapes) plus this much for everything else it carries
BODY_SLACK_BYTES = 1 << 20

# Text longer than this is tokenized on a worker thread instead of the event loop, which every
# request's streaming shares (a context's worth of text takes tens of milliseconds)
TOKENIZE_INLINE_CHARS = 8192

RETRY_AFTER_S = 5


class NotWarm(RuntimeError):
    pass


class Unfinished(RuntimeError):
    """A request that ended without its answer, as its client hears it: ``status`` 500 where the
    engine failed it, 503 (retry) where the replica stopped under it; ``kind``, the status its
    request is counted under in the metrics ("error", "stopped")."""

    def __init__(self, message: str, status: int, kind: str):
        super().__init__(message)
        self.status, self.kind = status, kind


def unfinished(handle: Any) -> Unfinished | None:
    """Why ``handle``'s request ended without its answer; None when it finished, or when its
    own client cancelled it (nobody is left to tell)."""
    if handle.finish_reason == "error":
        return Unfinished(f"generation failed: {handle.error!r}", 500, "error")
    if handle.finish_reason == "cancelled" and not handle.cancelled:
        return Unfinished("the replica stopped before the generation finished; retry", 503, "stopped")
    return None


def import_engine(device: str, timer: PhaseTimer | None = None) -> None:
    """A replica's imports once its trickle is started (the rest of its "imports" phase, which
    bench/cold_import.py times in a fresh process): Triton's import and per-process set-up on a
    side thread (``head_start``) while this one imports torch and the engine's modules.
    ``timer`` gets phase ``imports_torch``: of them, ``import torch`` (what the minimal replica
    of bench/serve.py pays too)."""
    from deployments import head_start
    from deployments.runtime import start_context
    start_context(device)  # the GPU's context, made by the driver while torch is imported
    head_start.start(device)
    with timer.phase("imports_torch") if timer else contextlib.nullcontext():
        import torch  # noqa: F401  (the cost is what the phase measures)

    import deployments.engine  # noqa: F401
    import deployments.model  # noqa: F401
    import deployments.tokenizer  # noqa: F401
    import weights.loader  # noqa: F401


def _start_trickle(path: Any, gpu: bool, opts: LoadOptions) -> bool:
    """On a GPU replica whose weights are mostly not in the page cache, start reading them
    one piece at a time (``weights.readahead.trickle``) at once, while the imports, the
    context and the engine's build run; whether it started. ``load.trickle: false`` turns
    it off, and O_DIRECT reads do without it. Imports nothing heavy: it runs before torch
    is imported."""
    if not gpu or not opts.trickle or opts.direct_io or opts.cold_direct_io:
        return False  # (O_DIRECT reads would not use what it read)
    if not is_cold(path):
        return False
    started = trickle(path, opts.trickle_read_bytes) is not None
    if started:
        log.info("%s: weights not in the page cache; reading them one piece at a time until "
                 "the engine is built", path)
    return started


class LLMServer:
    """A replica: one model on one device, served over HTTP.

    Args (keyword, as in serve_config.yaml's ``args``): see ``DeploymentArgs``.
    ``metrics``: where phases and request figures go (``Metrics(use_ray=True)``
    inside Ray). ``keep_bytecode``: the process keeps its compiled modules per node where
    its interpreter keeps none (``deployments.bytecode``; a Ray replica's own process).
    """

    def __init__(self, model: str = "weights/demo", *, model_name: str | None = None,
                 device: str = "auto", engine: dict | None = None, load: dict | None = None,
                 fault_injection: bool = False, metrics: Metrics | None = None, keep_bytecode: bool = False):
        t_start = time.perf_counter()
        self.started_at = time.time()  # Unix times of the start-up milestones, for /stats
        self.warm_at: float | None = None
        self.args = DeploymentArgs.from_dict(
            {"model": model, "model_name": model_name, "device": device,
             "engine": engine or {}, "load": load or {}, "fault_injection": fault_injection})
        # every response says which replica answered (x-coldstart-replica)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}"
        path = self.args.model_path()
        # checked before the imports: a bad field fails the replica at once, and the trickle
        # below decides from these before torch is imported
        opts = _from_dict(LoadOptions, self.args.load, "args.load")
        self.metrics = metrics or Metrics()
        self.timer = timer = PhaseTimer(sinks=[self.metrics.phase])
        self.warm = False
        self.warmups = 0
        self._t_start = t_start

        with timer.phase("imports"):
            from deployments import head_start
            trickling = _start_trickle(path, head_start.gpu_expected(self.args.device), opts)
            if keep_bytecode:
                from deployments import bytecode
                bytecode.enable()
            import_engine(self.args.device, timer)
        from deployments.engine import EngineConfig
        from deployments.model import is_native
        from deployments.runtime import check_env, choose_device, create_context, early_context
        from weights.loader import start_load
        for w in check_env():
            log.warning(w)
        with timer.phase("context"):
            self.device = choose_device(self.args.device)
            ahead = early_context() if self.device.type == "cuda" else None
            log.info("runtime: %s", create_context(self.device))
        if ahead is not None:  # of the imports' time, on a side thread
            timer.record("context_ahead", ahead)
        if not (path / "model.cst").is_file():
            raise FileNotFoundError(
                f"{path}: no packed model here (model.cst missing); make one with "
                "`coldstart pack HF_DIR " + str(path) + "`, or run `coldstart serve` for the demo")
        ecfg = _from_dict(EngineConfig, self.args.engine, "args.engine")
        t0 = time.perf_counter()
        # The loader's reads, and its read-ahead of the whole file, start once the buffer and its
        # views exist: not before the imports, the context and the views. A bulk read on the
        # same disk starves their page faults on torch's and CUDA's libraries (`import torch`
        # ended only when the weights were read, bench/cold_import.py; with a cold cache the
        # context took 6.8 s instead of 0.5, bench/results/runs/serve-v4-naive-warm.json).
        # The engine's build, beside the load, is what the read overlaps. On a cold page cache
        # the bulk read waits for the build too (hold, released below): the build's first
        # launches fault in pages of CUDA's, torch's and Triton's files, and beside the bulk
        # read they waited for all of it (the first kernel self-test took 6.9 s instead of
        # 0.4, bench/results/runs/serve-v6-build-beside-cold-read.json); the trickle, one
        # piece at a time, reads meanwhile.
        pending = start_load(path, self.device, options=opts, timer=timer, hold=trickling)
        native = is_native(pending.config)  # as build_model decides
        embed = pending.tensors.get("model.embed_tokens.weight") if native else None
        if embed is not None:  # the engine's first-use costs, beside the build (waited for before its capture)
            from deployments import prime
            prime.start(pending.config, self.device, embed.dtype)
        # The engine is built while the weights' bytes arrive: the model over the buffer's views,
        # the kernels' self-tests and GEMV choice (on their own inputs), the KV cache and the CUDA
        # graphs need the weights' shapes and addresses, never their values. Only a native model
        # can (transformers' classes may copy the weights as they take them).
        overlap = pending.background and build_during_load() and native
        loaded = None if overlap else self._finish_load(pending, t0)
        with _gil_switch(_OVERLAP_SWITCH_S if overlap else None):
            try:
                self._build_engine(pending, path, ecfg)
            except BaseException:
                if loaded is None:  # let the loader's threads end before the error unwinds the replica
                    pending.cancel()  # a held load reads nothing
                    try:
                        pending.wait()
                    except BaseException:  # noqa: BLE001 - the build's error is the one to report
                        pass
                stop_trickle(path)
                raise
            pending.release()
            if loaded is None:
                try:
                    with timer.phase("load_wait"):  # the part of the load the engine's build did not hide
                        loaded = self._finish_load(pending, t0)
                    self.model.weights_loaded()
                except BaseException:
                    self.engine.shutdown()  # a corrupt or unreadable file: nothing may serve its bytes
                    raise
        self.loaded = loaded
        self.model_name = self.args.model_name or path.name
        timer.record("constructor", time.perf_counter() - t_start)
        self._routes: dict[tuple[str, str], Callable] = {
            ("POST", "/generate"): self._generate,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/stats"): self._stats,
        }
        if self.args.fault_injection:
            self._routes[("POST", "/admin/fault")] = self._fault

    def _build_engine(self, pending: Any, path: Any, ecfg: Any) -> None:
        """Model over the load's tensor views, tokenizer, KV cache, CUDA graphs: phase engine."""
        from deployments.engine import Engine  # imported in the imports phase already (import_engine)
        from deployments.model import build_model
        from deployments.tokenizer import Tokenizer
        timer = self.timer
        with timer.phase("engine"):
            with timer.phase("engine_model"):
                self.model = build_model(pending.config, pending.tensors)
            for step, seconds in getattr(self.model, "build_s", {}).items():  # the native model's steps
                timer.record(f"engine_model_{step}", seconds)
            with timer.phase("engine_tokenizer"):
                self.tokenizer = Tokenizer.from_dir(path)
            with timer.phase("engine_kv_cache"):
                self.engine = Engine(self.model, self.tokenizer, ecfg)
            with timer.phase("engine_graphs"):  # first decode launches, graph capture, first prefills
                self.engine.start()

    def _finish_load(self, pending: Any, t0: float) -> Any:
        """Wait for the weights (re-raising a read or checksum error); record the load's phase:
        its own duration and rate, from its start, whatever ran beside it."""
        loaded = pending.wait()
        self.timer.record("load", pending.finished_at - t0, loaded.nbytes)
        if pending.held_s:
            self.timer.record("load_held", pending.held_s)  # of it, the bulk read's wait for the build
        return loaded

    # ---- lifecycle ---------------------------------------------------------
    def reconfigure(self, user_config: dict | None) -> None:
        """Run the warm-up plan; the replica is warm (and healthy) only after the first one.

        A later call (the plan changed) re-warms while the replica keeps serving:
        its weights and engine are loaded, and the router may still send it
        requests while it is being updated, so it must not turn them away.
        """
        plan = WarmupPlan.from_user_config(user_config)
        with self.timer.phase("warmup"):
            self._warmup(plan)
        if plan.hold_s and not self.warm:
            time.sleep(plan.hold_s)
        self.warmups += 1
        if not self.warm:
            self.warm = True
            self.warm_at = time.time()
            self.timer.record("total", time.perf_counter() - self._t_start)

    def _warmup(self, plan: WarmupPlan) -> None:
        seed = self.tokenizer.encode("The answer is forty-two. " * 8, add_special_tokens=False) or [3]
        run_warmup(self.engine, plan, seed)

    def check_health(self) -> None:
        """Cheap; raises when not warm, when the engine loop died, or on a GPU error."""
        if not self.warm:
            raise NotWarm("replica is not warm yet")
        if not self.engine.alive():
            raise RuntimeError(f"engine loop is not running: {self.engine.error!r}")
        from deployments.runtime import device_error
        with self.engine.capture_lock:  # its device-wide synchronize never lands inside a capture
            err = device_error(self.device)
        if err:
            raise RuntimeError(err)
        self.metrics.sample_gpu(self.device)
        # The graphs of the batch sizes the warm-up did not use (engine.lazy_graphs): captured by
        # the engine's loop whenever it is idle from the first health check that passed on. Not
        # at the end of the warm-up: Ray's first health check comes right after it, and this
        # check would wait for a capture under way, holding the replica's RUNNING back.
        self.engine.capture_deferred()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- HTTP --------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):  # an app mounted at a route prefix
            path = path[len(root):]
        path = path.rstrip("/") or "/"
        handler = self._routes.get((request.method, path))
        if handler is None:
            known = sorted({p for _, p in self._routes})
            allowed = [m for m, p in self._routes if p == path]
            if allowed:
                resp = _error(f"{request.method} not allowed on {path}; use {allowed[0]}", 405)
            else:
                resp = _error(f"no route {path}; routes: {', '.join(known)}", 404)
            resp.headers["x-coldstart-replica"] = self.replica_id
            return resp
        try:
            if not self.warm and handler not in (self._health, self._stats):
                self.metrics.request("not_warm")
                raise api.BadRequest("replica is warming up; retry shortly", 503)
            resp = await handler(request)
        except api.BadRequest as e:
            self.metrics.request("bad_request")
            resp = _error(str(e), e.status)
        except RuntimeError as e:  # one request failed inside the engine; the replica goes on
            log.error("request failed: %s", e)
            resp = _error(str(e), getattr(e, "status", 500))
        except Exception as e:  # a fault of this server's own: the request says so, the replica goes on
            log.exception("%s %s failed", request.method, path)
            self.metrics.request("error")
            resp = _error(f"internal error ({type(e).__name__}: {e}); the replica's log has the traceback", 500)
        resp.headers["x-coldstart-replica"] = self.replica_id
        return resp

    async def _submit(self, ids: list[int], params, doc: dict):
        """``ids`` with ``params`` into the engine; ``doc``, the request's body, says whether it
        sent a length limit (``api.fit_default_length``)."""
        api.fit_default_length(doc, params, len(ids), self.engine.config.max_seq_len)
        if not self.engine.alive():  # check_health will fail and Ray will replace this replica
            raise api.BadRequest(f"replica unavailable: engine loop is not running "
                                 f"({self.engine.error!r}); retry", 503)
        try:
            return self.engine.submit(ids, params)
        except ValueError as e:  # prompt too long, ids outside the vocabulary, ...
            raise api.BadRequest(str(e)) from e
        except RuntimeError as e:  # the engine loop died: this replica is going away
            raise api.BadRequest(f"replica unavailable: {e}", 503) from e

    async def _body(self, request: Request) -> bytes:
        """The request's body, refused with a 413 before it is all read where it is larger than
        any request this replica could serve: parsing 1 GB of JSON would hold the event loop
        (every other request) and the replica's memory."""
        tokens, chars = self._text_limit()
        limit = 12 * chars + BODY_SLACK_BYTES

        def too_big(size: str) -> api.BadRequest:
            return api.BadRequest(f"request body is {size} bytes, more than a request for a context of {tokens} "
                                  f"tokens can need ({limit:,}); shorten it", 413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big(f"{int(declared):,}")
        body = bytearray()
        async for piece in request.stream():  # a chunked body says no length: counted as it comes
            body += piece
            if len(body) > limit:
                raise too_big(f"more than {limit:,}")
        return bytes(body)

    def _text_limit(self) -> tuple[int, int]:
        """(the context's tokens, the most characters of text a request may send for it)."""
        tokens = self.engine.config.max_seq_len
        return tokens, tokens * MAX_CHARS_PER_TOKEN

    async def _encode(self, prompt: str) -> list[int]:
        self._check_size(len(prompt), "field 'prompt'")
        return await _off_loop(len(prompt), self.tokenizer.encode, prompt)

    def _check_size(self, chars: int, what: str) -> None:
        """Refuse text no context could hold before tokenizing it: 10 MB of text, tokenized on
        the event loop, held every other request up for seconds (and on a worker thread would
        still take them)."""
        tokens, limit = self._text_limit()
        if chars > limit:
            raise api.BadRequest(f"{what} is {chars:,} characters, more than a context of {tokens} tokens "
                                 f"takes ({limit:,}: {MAX_CHARS_PER_TOKEN} per token); shorten it")

    async def _run(self, handle) -> tuple[str, list[int], str]:
        text, ids = [], []
        try:
            async for ch in handle:
                text.append(ch.text)
                ids.extend(ch.token_ids)
        finally:
            if not handle.done:
                handle.cancel()  # the caller went away: free the slot
            self._account(handle)
        failed = unfinished(handle)
        if failed is not None:
            raise failed
        return "".join(text), ids, handle.finish_reason

    def _account(self, handle) -> None:
        # a client that went away has cancelled its handle; the engine may not have seen it yet
        failed = unfinished(handle)
        status = ("cancelled" if handle.cancelled and handle.finish_reason in (None, "cancelled")
                  else "ok" if failed is None else failed.kind)
        self.metrics.request(status)
        self.metrics.finished(handle.ttft_s, handle.decode_tokens_per_s, handle.queue_wait_s)

    async def _stream(self, handle, render: Callable[[Any], bytes | None],
                      tail: Callable[[Any], bytes] | None = None,
                      fail: Callable[[Unfinished], bytes] | None = None) -> AsyncIterator[bytes]:
        """The response body of a streamed request: ``render`` per chunk, then ``tail``. A request
        that ends without its answer (``unfinished``) ends with ``fail`` instead (SSE: an error
        event, which the ``openai`` client raises as an APIError), never with a finish reason
        that reads as a normal end."""
        from deployments.request import Chunk
        try:
            async for ch in handle:
                failed = unfinished(handle) if ch.finish_reason is not None else None
                if failed is not None:
                    log.error("streamed request failed: %s", failed)
                    piece = render(Chunk(ch.token_ids, ch.text, None)) if ch.text or ch.token_ids else None
                    if piece:
                        yield piece
                    yield (fail or _sse_fail)(failed)
                    return
                piece = render(ch)
                if piece:
                    yield piece
            if tail is not None:
                yield tail(handle)
        finally:
            if not handle.done:
                handle.cancel()
            self._account(handle)

    async def _generate(self, request: Request) -> Response:
        doc = api.parse_json(await self._body(request))
        prompt, params, stream = api.parse_generate(doc)
        ids = await self._encode(prompt)
        handle = await self._submit(ids, params, doc)
        if stream:
            def render(ch) -> bytes:
                return (json.dumps({"text": ch.text, "token_ids": ch.token_ids,
                                    "finish_reason": ch.finish_reason}) + "\n").encode()

            def fail(e: Unfinished) -> bytes:  # the last line: finish_reason "error" and why
                return (json.dumps({"text": "", "token_ids": [], "finish_reason": "error",
                                    **api.error_body(str(e), e.status)}) + "\n").encode()
            return StreamingResponse(self._stream(handle, render, fail=fail), media_type="application/x-ndjson")
        text, out, reason = await self._run(handle)
        return JSONResponse({"text": text, "token_ids": out, "finish_reason": reason,
                             "usage": api.usage(len(ids), len(out)),
                             "ttft_s": handle.ttft_s})

    def _sse_tail(self, doc: dict, rid: str, obj: str, n_prompt: int) -> Callable[[Any], bytes]:
        """The end of an SSE stream: an optional usage chunk, then [DONE]."""
        with_usage = api.wants_usage_chunk(doc)

        def tail(h) -> bytes:
            out = b""
            if with_usage:
                out += api.sse(api.usage_chunk(rid, self.model_name, obj, n_prompt, h.n_tokens))
            return out + api.sse("[DONE]")
        return tail

    async def _completions(self, request: Request) -> Response:
        doc = api.parse_json(await self._body(request))
        prompt, params, stream = api.parse_completion(doc)
        ids = await self._encode(prompt)
        rid, model = api.new_id("cmpl"), self.model_name
        tail = self._sse_tail(doc, rid, "text_completion", len(ids))  # validates stream_options
        handle = await self._submit(ids, params, doc)
        if stream:
            return StreamingResponse(self._stream(
                handle, lambda ch: api.sse(api.completion_chunk(rid, model, ch.text, ch.finish_reason)),
                tail), media_type="text/event-stream")
        text, out, reason = await self._run(handle)
        return JSONResponse(api.completion_body(rid, model, text, reason, len(ids), len(out)))

    async def _chat(self, request: Request) -> Response:
        doc = api.parse_json(await self._body(request))
        messages, params, stream = api.parse_chat(doc)
        chars = sum(len(m["content"]) for m in messages)
        self._check_size(chars, "field 'messages' (their content)")
        try:
            ids = await _off_loop(chars, self.tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                  tokenize=True)
        except ValueError as e:  # no template, or the template rejected the messages
            raise api.BadRequest(str(e)) from e
        except Exception as e:  # jinja2 raises its own types for a template's raise_exception
            raise api.BadRequest(f"chat template rejected the messages: {e}") from e
        rid, model = api.new_id("chatcmpl"), self.model_name
        tail = self._sse_tail(doc, rid, "chat.completion.chunk", len(ids))
        handle = await self._submit(ids, params, doc)
        if stream:
            first = [True]

            def render(ch) -> bytes:
                out = b""
                if first[0]:
                    first[0] = False
                    out += api.sse(api.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
                if ch.text or ch.finish_reason:
                    delta = {"content": ch.text} if ch.text else {}
                    out += api.sse(api.chat_chunk(rid, model, delta, ch.finish_reason))
                return out
            return StreamingResponse(self._stream(handle, render, tail),
                                     media_type="text/event-stream")
        text, out, reason = await self._run(handle)
        return JSONResponse(api.chat_body(rid, model, text, reason, len(ids), len(out)))

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "coldstart",
             "digest": self.loaded.packed.digest}]})

    async def _health(self, request: Request) -> Response:
        if not self.warm:
            return _error("warming up", 503)
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def _fault(self, request: Request) -> Response:
        """Drills (args.fault_injection only): stop the engine loop, as a crashed one would be."""
        kind = api.parse_json(await self._body(request)).get("kind")
        if kind != "engine_stop":
            raise api.BadRequest(f"field 'kind' must be 'engine_stop', got {kind!r}")
        log.warning("fault injection: stopping the engine loop")
        self.engine.shutdown()
        return JSONResponse({"injected": kind, "replica": self.replica_id})

    async def _stats(self, request: Request) -> Response:
        from deployments import IMPORTED_AT, early
        from deployments.runtime import process_start_time
        return JSONResponse({"warm": self.warm, "replica": self.replica_id,
                             "process_started_at": process_start_time(), "imported_at": IMPORTED_AT,
                             "early_import": early.times(), "gc": early.gc_state(),
                             "constructor_started_at": self.started_at, "warm_at": self.warm_at,
                             "engine": self.engine.stats(),
                             **self.metrics.snapshot()})


# While the engine is built beside the load, the build (Python-heavy: kernel launches, graph
# capture) would keep the GIL for the default 5 ms each time a loader thread asks for it
# back, several times per piece it reads; 0.5 ms bounds that wait
_OVERLAP_SWITCH_S = 0.0005


async def _off_loop(chars: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) for ``chars`` characters of text: inline when short, else on a worker
    thread (``TOKENIZE_INLINE_CHARS``), so that the event loop goes on streaming meanwhile."""
    if chars <= TOKENIZE_INLINE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


@contextlib.contextmanager
def _gil_switch(seconds: float | None) -> Iterator[None]:
    """sys.setswitchinterval(seconds) inside the block (None: unchanged)."""
    old = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def build_during_load() -> bool:
    """COLDSTART_BUILD_DURING_LOAD (default 1): build the engine while the weights load;
    0 builds it after the load (slower; for comparison and diagnosis)."""
    v = os.environ.get("COLDSTART_BUILD_DURING_LOAD", "1").strip().lower()
    if v not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        log.warning("COLDSTART_BUILD_DURING_LOAD=%r is not 0 or 1: using 1", v)
        return True
    return v in ("1", "true", "yes", "on")


def run_warmup(engine: Any, plan: WarmupPlan, seed: list[int]) -> None:
    """Run a warm-up plan on an engine: per round and batch size, that many greedy shadow
    requests at once, each a prompt of ``plan.prompt_fraction`` of the context (``seed``
    repeated) and ``plan.decode_tokens`` new tokens: the same path as a user's request.
    (Every prefill shape has run once already, in ``Engine.start``.)"""
    from deployments.request import SamplingParams
    cfg = engine.config
    plen = max(1, min(int(plan.prompt_fraction * cfg.max_seq_len), cfg.max_seq_len - plan.decode_tokens))
    prompt = (seed * (plen // len(seed) + 1))[:plen]
    params = SamplingParams(max_new_tokens=plan.decode_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(plan.requests):
        for b in plan.batch_sizes:
            handles = [engine.submit(prompt, params) for _ in range(min(b, cfg.max_slots))]
            for h in handles:
                _, _, reason = h.result()
                if reason == "error":
                    raise RuntimeError(f"warm-up request failed: {h.error!r}")


def _sse_fail(e: Unfinished) -> bytes:
    """An SSE stream's end for a request that failed: an error event, then [DONE]."""
    return api.sse(api.error_body(str(e), e.status)) + api.sse("[DONE]")


def _error(message: str, status: int) -> JSONResponse:
    """An error response; a 503 (warming up, overloaded, stopped: try again) says when, in Retry-After."""
    return JSONResponse(api.error_body(message, status), status_code=status,
                        headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None)
