"""Tokenizer for a packed model directory, without transformers.

Reads `tokenizer.json` with the `tokenizers` library, bos/eos/add_bos_token and
`chat_template` from `tokenizer_config.json` (or `chat_template.jinja`), and
eos_token_id from `generation_config.json`. jinja2 is imported only when a chat
template is first rendered.

`IncrementalDecoder` turns a token stream into text deltas that never split a
multi-byte UTF-8 character (byte-level BPE and sentencepiece byte-fallback both
decode a partial character as U+FFFD; we wait for the rest).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)


def _token_str(tok: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or AddedToken dicts
    if tok is None or isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        return tok.get("content")
    raise ValueError(f"tokenizer_config.json: special token {tok!r} is neither a string nor an AddedToken dict")


_REPACK = "copy it again from the model's source and pack again"


def _read_json(path: Path) -> dict:
    from weights.format import read_json

    return read_json(path, _REPACK) if path.exists() else {}


class Tokenizer:
    """encode / decode / chat template / eos ids for one model directory."""

    def __init__(
        self,
        tok: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Sequence[int] = (),
    ):
        self._tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        # None: let tokenizer.json's post-processor decide (it adds BOS for Llama 2/3)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: list[int] = sorted(set(ids) | set(extra_eos_ids))
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a packed (or HF) model directory.

        Raises FileNotFoundError if tokenizer.json is missing.
        """
        from weights.format import read_tokenizer

        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.exists():
            raise FileNotFoundError(
                f"{d}: no tokenizer.json. The engine needs the fast-tokenizer file; re-pack the model "
                f"from an HF checkpoint that has one (or save it with a fast tokenizer first)"
            )
        tc = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")
        template = tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        where = d / "tokenizer_config.json"
        if template is None and (d / "chat_template.jinja").exists():
            where = d / "chat_template.jinja"
            template = where.read_text(encoding="utf-8")
        eos_ids = gen.get("eos_token_id")
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        tok = cls(
            read_tokenizer(tj, _REPACK),
            bos_token=_token_str(tc.get("bos_token")),
            eos_token=_token_str(tc.get("eos_token")),
            add_bos_token=tc.get("add_bos_token"),
            chat_template=template,
            extra_eos_ids=eos_ids,
        )
        if template is not None:  # checked now, not at the first chat request
            tok._template = _checked_template(template, where)
        return tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tokenize: bool = False, **kwargs: Any
    ) -> str | list[int]:
        """Render `messages` like transformers does; tokenize=True returns ids (no extra BOS: the template has it)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat_template (tokenizer_config.json); send a plain prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def incremental_decoder(self, prompt_ids: Sequence[int] = ()) -> "IncrementalDecoder":
        return IncrementalDecoder(self, prompt_ids)


def _checked_template(source: Any, where: Path) -> Any:
    """The chat template ``source`` (from the file ``where``) compiled; ValueError naming the file,
    the line and what to do where it is not a template jinja2 can parse."""
    import jinja2

    if not isinstance(source, str):
        raise ValueError(f"{where}: its chat template is a JSON {type(source).__name__}, not a string; "
                         f"{_REPACK}")
    try:
        return _compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: its chat template does not parse (line {e.lineno}: {e.message}); fix the "
                         f"template or {_REPACK}") from None


def _compile_template(source: str) -> Any:
    import jinja2  # lazy: only chat requests need it
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # Same environment settings as transformers' chat-template rendering.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class IncrementalDecoder:
    """Streaming detokenizer: `push(token_id)` returns the new text, never half a character.

    Decodes a short window of tokens (prefix + new) and emits the difference, as
    vLLM/TGI do, so the cost per token stays constant and sentencepiece's
    leading-space rules see the previous token. A few prompt tokens seed the
    window so the first generated word gets its leading space right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens up to here have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the very end)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
