"""The HTTP API's request parsing and response shapes: /generate and OpenAI's.

Parsing turns a JSON body into (prompt or messages, SamplingParams) and raises
``BadRequest`` (-> 400) naming the field for anything wrong. The OpenAI shapes
follow the Completions and Chat Completions APIs closely enough that the
official ``openai`` client works unchanged; fields that only change what is
sent back (``user``, ``logit_bias`` empty, ...) are accepted and ignored, and
fields asking for something this server does not do (``n`` > 1, logprobs)
are refused with a 400 instead of being silently dropped.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from deployments.request import SamplingParams, cut


class BadRequest(ValueError):
    """A client error: the message goes back with a 4xx."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _js(v: Any) -> str:
    return cut(json.dumps(v))


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


def _text(v: str, field: str) -> str:
    """v, which JSON may carry with a lone surrogate (``"\\ud800"``): no tokenizer takes that."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{field} is not valid Unicode text: a lone surrogate "
                         f"(\\u{ord(v[e.start]):04x}) at character {e.start}; send UTF-8 text") from None
    return v


def _bool(doc: dict, key: str) -> bool:
    v = doc.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"field '{key}' must be true or false, got {_js(v)}")
    return v


def _num(doc: dict, key: str, kind: type, default: Any) -> Any:
    v = doc.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) if kind is float else isinstance(v, kind)
    if not ok or isinstance(v, bool):
        raise BadRequest(f"field '{key}' must be {'a number' if kind is float else 'an integer'}, "
                         f"got {_js(v)}")
    return kind(v)


def _stops(doc: dict, key: str = "stop") -> list[str]:
    v = doc.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        return [_text(v, f"field '{key}'")]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [_text(s, f"field '{key}'") for s in v]
    raise BadRequest(f"field '{key}' must be a string or a list of strings, got {_js(v)}")


def _sampling(doc: dict, max_key: str, default_max: int) -> SamplingParams:
    p = SamplingParams(
        max_new_tokens=_num(doc, max_key, int, default_max),
        temperature=_num(doc, "temperature", float, 1.0),
        top_p=_num(doc, "top_p", float, 1.0),
        top_k=_num(doc, "top_k", int, 0),
        seed=_num(doc, "seed", int, None),
        stop=_stops(doc),
        stop_token_ids=doc.get("stop_token_ids") or [],
        ignore_eos=_bool(doc, "ignore_eos"),
    )
    try:
        p.validate()
    except ValueError as e:  # name the field as the client spelled it
        msg = re.sub(r"SamplingParams\.(\w+)",
                     lambda m: f"field '{max_key if m.group(1) == 'max_new_tokens' else m.group(1)}'",
                     str(e))
        raise BadRequest(msg) from e
    return p


def fit_default_length(doc: dict, params: SamplingParams, prompt_tokens: int, max_seq_len: int) -> None:
    """A request that names no length limit (max_new_tokens, max_tokens, max_completion_tokens)
    gets its route's default cut to the room its prompt leaves in the context, instead of a
    400 about a field it never sent. A limit the client sent is left as it is."""
    if all(doc.get(k) is None for k in ("max_new_tokens", "max_tokens", "max_completion_tokens")):
        if prompt_tokens < max_seq_len:
            params.max_new_tokens = min(params.max_new_tokens, max_seq_len - prompt_tokens)


GENERATE_FIELDS = {"prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "stream"}


def parse_generate(doc: dict) -> tuple[str, SamplingParams, bool]:
    """``POST /generate``: {prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, stream}."""
    unknown = sorted(set(doc) - GENERATE_FIELDS)
    if unknown:
        more = f" and {len(unknown) - 10:,} more" if len(unknown) > 10 else ""
        raise BadRequest(f"unknown field(s) {', '.join(unknown[:10])}{more}; /generate takes "
                         f"{', '.join(sorted(GENERATE_FIELDS))}")
    prompt = doc.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("field 'prompt' must be a non-empty string")
    return _text(prompt, "field 'prompt'"), _sampling(doc, "max_new_tokens", 128), _bool(doc, "stream")


_UNSUPPORTED_OK = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
                   "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
                   "functions": (None, []), "tool_choice": (None, "none"),
                   "response_format": (None, {"type": "text"}),
                   # sampling this server does not do: only their neutral values pass
                   "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}


def wants_usage_chunk(doc: dict) -> bool:
    """OpenAI's ``stream_options: {"include_usage": true}``: a last chunk with usage."""
    opts = doc.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest(f"field 'stream_options' must be an object, got {_js(opts)}")
    return bool((opts or {}).get("include_usage", False))


def _openai_common(doc: dict) -> None:
    n = doc.get("n", 1)
    if n not in (1, None):
        raise BadRequest(f"field 'n' must be 1 (one choice per request), got {_js(n)}")
    for key, fine in _UNSUPPORTED_OK.items():
        if key in doc and doc[key] not in fine:
            raise BadRequest(f"field '{key}'={_js(doc[key])} is not supported by this server")


def parse_completion(doc: dict) -> tuple[str, SamplingParams, bool]:
    """``POST /v1/completions`` (OpenAI): prompt, max_tokens (default 16), stop, stream, ..."""
    _openai_common(doc)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("field 'prompt' must be a non-empty string (one prompt per request)")
    return _text(prompt, "field 'prompt'"), _sampling(doc, "max_tokens", 16), _bool(doc, "stream")


def parse_chat(doc: dict) -> tuple[list[dict], SamplingParams, bool]:
    """``POST /v1/chat/completions`` (OpenAI): messages, max_tokens / max_completion_tokens, ..."""
    _openai_common(doc)
    msgs = doc.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("field 'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}] parts
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported")
            for k, p in enumerate(content):
                if not isinstance(p.get("text"), str):
                    raise BadRequest(f"messages[{i}].content[{k}].text must be a string, got {_js(p.get('text'))}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string")
        out.append({"role": _text(m["role"], f"messages[{i}].role"),
                    "content": _text(content, f"messages[{i}].content")})
    key = "max_completion_tokens" if doc.get("max_completion_tokens") is not None else "max_tokens"
    return out, _sampling(doc, key, 256), _bool(doc, "stream")


# ---- responses -------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_finish(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length" (a failed request gets an error instead, LLMServer._stream;
    # a request its client cancelled has nobody left to read its "stop")
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_body(rid: str, model: str, text: str, reason: str, pt: int, ct: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": openai_finish(reason),
                         "logprobs": None}],
            "usage": usage(pt, ct)}


def completion_chunk(rid: str, model: str, text: str, reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": openai_finish(reason),
                         "logprobs": None}]}


def chat_body(rid: str, model: str, text: str, reason: str, pt: int, ct: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": openai_finish(reason)}],
            "usage": usage(pt, ct)}


def chat_chunk(rid: str, model: str, delta: dict, reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "delta": delta,
                                         "finish_reason": openai_finish(reason)}]}


def usage_chunk(rid: str, model: str, obj: str, pt: int, ct: int) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(pt, ct)}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def error_body(message: str, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}
