"""Tokenizer: encode/decode, special tokens, chat template, incremental decoding."""

from __future__ import annotations

import json
import sys

import pytest

from deployments.engine.tokenizer import Tokenizer
from helpers_engine import write_tokenizer_dir

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"), chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_special_tokens_and_eos(tok):
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"  # eos given as an AddedToken dict
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.eos_token_ids == [1]


def test_encode_adds_bos_and_round_trips(tok):
    text = "Hello world, Grüße 日本語 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text


def test_add_bos_false(tmp_path):
    t = Tokenizer.from_dir(write_tokenizer_dir(tmp_path, add_bos=False))
    assert t.encode("Hello")[0] != t.bos_token_id


def test_missing_tokenizer_json_names_dir_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path.name}.*tokenizer.json.*re-pack"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_renders_like_transformers(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<s><|system|>be brief</s><|user|>hi</s><|assistant|>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("hi</s>")
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # template's BOS, no second one


def test_chat_template_raise_exception(tok):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_same_as_transformers(tok_dir, tok):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    ref.chat_template = TEMPLATE
    msgs = [{"role": "user", "content": "Grüße"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_no_chat_template_is_a_clear_error(tmp_path):
    t = Tokenizer.from_dir(write_tokenizer_dir(tmp_path))
    with pytest.raises(ValueError, match="no chat_template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_decoding_never_splits_characters(tok):
    text = "Grüße aus Köln! 日本語のテキスト。 emoji 🙂 too."
    ids = tok.encode(text, add_special_tokens=False)
    dec = tok.incremental_decoder()
    deltas = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # the test can fail: byte-level BPE really does split characters across tokens here
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_incremental_decoding_after_prompt_keeps_spaces(tok):
    prompt = tok.encode("Hello world,", add_special_tokens=False)
    out = tok.encode(" the quick brown fox", add_special_tokens=False)
    dec = tok.incremental_decoder(prompt)
    assert "".join(dec.push(i) for i in out) + dec.flush() == " the quick brown fox"


def test_generation_config_int_eos(tmp_path):
    d = write_tokenizer_dir(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(d).eos_token_ids == [0, 1]


def test_jinja2_is_imported_only_for_a_chat_template(tmp_path):
    import subprocess

    d = write_tokenizer_dir(tmp_path)  # no chat template
    code = ("import sys; from deployments.engine.tokenizer import Tokenizer;"
            f"t = Tokenizer.from_dir({str(d)!r}); t.encode('hi'); print('jinja2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


@pytest.mark.parametrize("where, template, msg", [
    ("tokenizer_config.json", "{% for m in messages %}{{ m.content }", "does not parse (line 1: unexpected '}'"),
    ("tokenizer_config.json", {"not": "a template"}, "its chat template is a JSON dict, not a string"),
    ("chat_template.jinja", "{% if %}", "chat_template.jinja: its chat template does not parse (line 1"),
])
def test_a_broken_chat_template_fails_the_load_not_the_first_chat(tmp_path, where, template, msg):
    """A chat template that does not parse used to fail only at the first chat request; now the
    tokenizer's load names the file, the line and what to do."""
    d = write_tokenizer_dir(tmp_path)
    if where == "chat_template.jinja":
        (d / where).write_text(template)
    else:
        tc = json.loads((d / where).read_text())
        (d / where).write_text(json.dumps({**tc, "chat_template": template}))
    with pytest.raises(ValueError) as e:
        Tokenizer.from_dir(d)
    assert msg in str(e.value) and str(d / where) in str(e.value) and "pack again" in str(e.value)


@pytest.mark.parametrize("name, text, msg", [
    ("tokenizer.json", "{", "tokenizer.json: the tokenizers library cannot read it"),
    ("tokenizer_config.json", "3", "tokenizer_config.json: holds a JSON int, not an object"),
    ("generation_config.json", "{eos", "generation_config.json: not valid JSON"),
])
def test_a_side_file_changed_after_packing_names_itself(tok_dir, tmp_path, name, text, msg):
    """A packed directory whose tokenizer files broke after packing: the error names the file
    and what to do, instead of the library's bare message."""
    import shutil

    d = tmp_path / "tok"
    shutil.copytree(tok_dir, d)
    (d / name).write_text(text)
    with pytest.raises(ValueError, match=msg) as e:
        Tokenizer.from_dir(d)
    assert str(d / name) in str(e.value) and "pack again" in str(e.value)
