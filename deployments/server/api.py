"""The HTTP API's request models and response shapes: /generate and OpenAI's.

A request body is a pydantic model (``GenerateRequest``, ``CompletionRequest``,
``ChatRequest``: their JSON schemas are the OpenAPI document's), turned into (prompt or
messages, ``SamplingParams``) by ``parse_*``; anything wrong raises ``BadRequest`` (a 4xx)
naming the field as the client spelled it, what it must be and what was sent (at most 200
characters of it). The OpenAI shapes follow the Completions and Chat Completions APIs closely
enough that the official ``openai`` client works unchanged: fields that only change what is
sent back are accepted and ignored, and fields asking for something this server does not do
(``n`` > 1, logprobs, penalties) are refused instead of being silently dropped.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.engine.request import SamplingParams, cut


# seconds a 503 (warming up, overloaded, stopped: try again) tells its client to wait, in Retry-After
RETRY_AFTER_S = 5


class BadRequest(ValueError):
    """A client error: the message goes back with a 4xx; ``param`` (the field at fault) and
    ``code`` (OpenAI's, where it has a precise one) go in its error body."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class Unavailable(RuntimeError):
    """The replica cannot take the request now but another (or this one, shortly) can: a 503
    with Retry-After. ``kind``: the status it is counted under in the metrics ("not_warm" while
    the replica warms up, "stopped" once its engine loop has stopped)."""

    status = 503

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _js(v: Any) -> str:
    """``v`` as the client sent it, cut to 200 characters (escaped where it is not valid text)."""
    text = json.dumps(v, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(v)
    return cut(text)


def _lone_surrogate(v: Any, where: str = "") -> None:
    """BadRequest naming the first string of ``v`` (a parsed body) that holds a lone surrogate:
    JSON may carry one (``"\ud800"``), no tokenizer or response takes it."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(f"field '{where}' is not valid Unicode text: a lone surrogate "
                             f"(\\u{ord(v[e.start]):04x}) at character {e.start}; send UTF-8 text") from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _lone_surrogate(k, where or "(a field name)")
            _lone_surrogate(x, f"{where}.{k}" if where else k)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _lone_surrogate(x, f"{where}[{i}]")


def parse_json(body: bytes) -> dict:
    if not body:
        raise BadRequest("request body is empty: send a JSON object")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(doc).__name__}")
    return doc


# ---------------------------------------------------------------- request models

_STRICT = ConfigDict(strict=True, use_attribute_docstrings=True)


class _Sampling(BaseModel):
    """What every route shares."""

    model_config = _STRICT
    temperature: float | None = None
    """0 (or below 1e-5) is greedy; default 1."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p; default 1."""
    top_k: int | None = None
    """Sample among the k likeliest tokens; 0 (default) is off."""
    seed: int | None = None
    """Seeded sampling gives the same tokens whatever else the replica runs."""
    stop: str | list[str] | None = None
    """Strings that end the answer (not returned with it); at most 64."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the answer, beside the model's end-of-sequence ids; at most 1,024."""
    ignore_eos: bool | None = None
    """Keep going past the model's end-of-sequence tokens."""
    stream: bool | None = None
    """Stream the answer (NDJSON lines on /generate, server-sent events on the OpenAI routes)."""


class GenerateRequest(_Sampling):
    """``POST /generate``."""

    model_config = ConfigDict(extra="forbid", **_STRICT)
    prompt: str = Field(min_length=1)
    """The text to continue."""
    max_new_tokens: int | None = None
    """Tokens to generate at most; default 128 or the room the prompt leaves in the context."""


class _OpenAI(_Sampling):
    model_config = ConfigDict(extra="allow", **_STRICT)  # OpenAI clients send fields that change nothing here
    model: str | None = None
    """The served model's id (``GET /v1/models``); another id gets a 404 (model_not_found). May be left out."""
    max_tokens: int | None = None
    """Tokens to generate at most."""
    n: Literal[1] | None = None
    """Choices per request: 1 only."""
    stream_options: dict | None = None
    """``{"include_usage": true}``: a last chunk with the token counts."""


class CompletionRequest(_OpenAI):
    """``POST /v1/completions`` (OpenAI)."""

    prompt: str | list[str]
    """The text to continue (one prompt per request)."""


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", **_STRICT)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", **_STRICT)
    role: str
    content: str | list[TextPart]


class ChatRequest(_OpenAI):
    """``POST /v1/chat/completions`` (OpenAI)."""

    messages: list[Message] = Field(min_length=1)
    """The conversation, rendered with the model's chat template."""
    max_completion_tokens: int | None = None
    """Tokens to generate at most (OpenAI's newer name for max_tokens)."""


class FaultRequest(BaseModel):
    """``POST /admin/fault`` (``args.fault_injection`` only)."""

    model_config = ConfigDict(extra="forbid", **_STRICT)
    kind: Literal["engine_stop"]
    """engine_stop: stop the engine loop, as a crashed one would be."""


# what a field must be, where the error type alone does not say it
_MUST = {"prompt": "a non-empty string", "stop": "a string or a list of strings", "messages":
         "a non-empty list of {role, content} objects", "content": "a string or a list of text parts",
         "n": "1 (one choice per request)", "kind": "'engine_stop'", "stream_options": "an object"}
_KIND = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
         "string_type": "a string", "list_type": "a list", "dict_type": "an object",
         "model_type": "an object", "model_attributes_type": "an object"}


def _where(loc: tuple) -> str:
    """A field's path as the client wrote it: messages[0].content[1].text."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif x in ("str", "list[str]", "list[TextPart]", "1") or x.startswith(("list[", "literal[")):
            break  # a union's branch: the field itself is what the client got wrong
        else:
            out += ("." if out else "") + x
    return out


def validate(cls: type[BaseModel], doc: dict) -> Any:
    """``cls`` from ``doc``; BadRequest naming the first field at fault."""
    _lone_surrogate(doc)
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        err = errs[0]
        where = _where(err["loc"])
        name = where.rsplit(".", 1)[-1].split("[")[0]
        if err["type"] == "extra_forbidden":
            unknown = sorted({_where(x["loc"]) for x in errs if x["type"] == "extra_forbidden"})
            more = f" and {len(unknown) - 10:,} more" if len(unknown) > 10 else ""
            raise BadRequest(f"unknown field(s) {', '.join(cut(u, 60) for u in unknown[:10])}{more}; this route "
                             f"takes {', '.join(sorted(cls.model_fields))}") from None
        if err["type"] == "missing":
            raise BadRequest(f"field '{where}' is required: {_MUST.get(name, _KIND.get('', 'a value'))}") from None
        given = doc
        for x in err["loc"]:
            if isinstance(given, dict) and x in given:
                given = given[x]
            elif isinstance(given, list) and isinstance(x, int) and x < len(given):
                given = given[x]
        must = _MUST.get(name) or _KIND.get(err["type"]) or err["msg"].removeprefix("Input should be ")
        raise BadRequest(f"field '{where}' must be {must}, got {_js(given)}") from None


@dataclass
class Parsed:
    """A request as the engine takes it: its prompt (or chat messages) and sampling parameters,
    whether to stream, and its length limit's name as this route spells it (``length_key``) and
    whether the client sent one (``sent_length``)."""

    params: SamplingParams
    stream: bool
    length_key: str
    sent_length: bool
    prompt: str = ""
    messages: list[dict] = field(default_factory=list)
    model: str | None = None  # the OpenAI routes' model id, as sent (None: not sent)
    usage_chunk: bool = False  # OpenAI's stream_options.include_usage: a last chunk with usage

    def fit_default_length(self, prompt_tokens: int, max_seq_len: int) -> None:
        """A request that names no length limit gets its route's default cut to the room its prompt
        leaves in the context, instead of a 400 about a field it never sent."""
        if not self.sent_length and prompt_tokens < max_seq_len:
            self.params.max_new_tokens = min(self.params.max_new_tokens, max_seq_len - prompt_tokens)


def _sampling(req: _Sampling, key: str, limit: int | None, default: int) -> SamplingParams:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    p = SamplingParams(
        max_new_tokens=default if limit is None else limit,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=stops,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
    )
    try:
        p.validate()
    except ValueError as e:  # name the field as the client spelled it
        raise BadRequest(re.sub(r"SamplingParams\.(\w+)",
                                lambda m: f"field '{key if m.group(1) == 'max_new_tokens' else m.group(1)}'",
                                str(e))) from e
    return p


def parse_generate(doc: dict) -> Parsed:
    """``POST /generate``."""
    req = validate(GenerateRequest, doc)
    return Parsed(_sampling(req, "max_new_tokens", req.max_new_tokens, 128), bool(req.stream), "max_new_tokens",
                  req.max_new_tokens is not None, prompt=req.prompt)


# sampling options this server does not do: only their neutral values pass
_UNSUPPORTED_OK = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
                   "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
                   "functions": (None, []), "tool_choice": (None, "none"),
                   "response_format": (None, {"type": "text"}),
                   "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}


def _openai_common(doc: dict) -> None:
    for key, fine in _UNSUPPORTED_OK.items():
        if key in doc and doc[key] not in fine:
            raise BadRequest(f"field '{key}'={_js(doc[key])} is not supported by this server")


def parse_completion(doc: dict) -> Parsed:
    """``POST /v1/completions`` (OpenAI)."""
    _openai_common(doc)
    req = validate(CompletionRequest, doc)
    prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("field 'prompt' must be a non-empty string (one prompt per request), "
                         f"got {_js(doc.get('prompt'))}")
    return Parsed(_sampling(req, "max_tokens", req.max_tokens, 16), bool(req.stream), "max_tokens",
                  req.max_tokens is not None, prompt=prompt, model=req.model,
                  usage_chunk=bool((req.stream_options or {}).get("include_usage", False)))


def parse_chat(doc: dict) -> Parsed:
    """``POST /v1/chat/completions`` (OpenAI)."""
    _openai_common(doc)
    req = validate(ChatRequest, doc)
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": content})
    key, limit = (("max_completion_tokens", req.max_completion_tokens) if req.max_completion_tokens is not None
                  else ("max_tokens", req.max_tokens))
    return Parsed(_sampling(req, key, limit, 256), bool(req.stream), key, limit is not None, messages=messages,
                  model=req.model,
                  usage_chunk=bool((req.stream_options or {}).get("include_usage", False)))


# ---------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_finish(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length" (a failed request gets an error instead; a request its
    # client cancelled has nobody left to read its "stop")
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_body(rid: str, model: str, text: str, reason: str, pt: int, ct: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": openai_finish(reason), "logprobs": None}],
            "usage": usage(pt, ct)}


def completion_chunk(rid: str, model: str, text: str, reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": openai_finish(reason), "logprobs": None}]}


def chat_body(rid: str, model: str, text: str, reason: str, pt: int, ct: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": openai_finish(reason)}],
            "usage": usage(pt, ct)}


def chat_chunk(rid: str, model: str, delta: dict, reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": openai_finish(reason)}]}


def usage_chunk(rid: str, model: str, obj: str, pt: int, ct: int) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(pt, ct)}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def error_body(message: str, status: int, *, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error shape: ``code`` is the HTTP status unless a more precise one is given
    (``model_not_found``); ``param``, the request field at fault, where one is."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status if code is None else code}}


def replay(body: bytes, then: Any) -> Any:
    """An ASGI ``receive`` that gives the whole ``body``, read earlier, as one message, then awaits
    ``then()`` (what the client sends next: its disconnect) for every later call."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()
    return receive
