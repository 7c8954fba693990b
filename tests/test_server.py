"""The replica without Ray: its HTTP front and validation (its start, config and health before
serving: test_replica_start.py)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from deployments.server.http import build
from deployments.server.replica import LLMServer


@pytest.fixture(scope="module")
def server(tiny_packed):
    s = LLMServer(str(tiny_packed), engine={"max_slots": 4, "max_seq_len": 256},
                  fault_injection=True)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def client(server):
    server.reconfigure({"warmup": {"requests": 1, "batch_sizes": [1, 2]}})
    return TestClient(build(server))


def test_startup_phases_recorded(server):
    phases = server.timer.as_dict()
    for name in ("imports", "context", "open", "verify", "load", "engine", "constructor", "engine_model",
                 "engine_model_assemble", "engine_tokenizer", "engine_kv_cache", "engine_graphs"):
        assert name in phases, name
    # the native model's build steps are parts of engine_model
    steps = sum(v for k, v in phases.items() if k.startswith("engine_model_"))
    assert 0 < steps <= phases["engine_model"]
    assert server.metrics.load_gbps and server.metrics.load_gbps > 0


def test_generate_the_articles_call(client):
    r = client.post("/generate", json={"prompt": "The answer is ", "max_new_tokens": 128,
                                       "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] in ("length", "stop")
    assert 1 <= body["usage"]["completion_tokens"] <= 128
    assert isinstance(body["text"], str)
    assert r.headers["x-coldstart-replica"]


def test_greedy_is_deterministic_and_seeded_sampling_repeats(client):
    a = client.post("/generate", json={"prompt": "Hello", "max_new_tokens": 12, "temperature": 0}).json()
    b = client.post("/generate", json={"prompt": "Hello", "max_new_tokens": 12, "temperature": 0}).json()
    assert a["token_ids"] == b["token_ids"]
    s1 = client.post("/generate", json={"prompt": "Hello", "max_new_tokens": 12, "temperature": 1.0,
                                        "seed": 7}).json()
    s2 = client.post("/generate", json={"prompt": "Hello", "max_new_tokens": 12, "temperature": 1.0,
                                        "seed": 7}).json()
    assert s1["token_ids"] == s2["token_ids"]


def test_generate_streams_ndjson(client):
    with client.stream("POST", "/generate", json={"prompt": "Hi", "max_new_tokens": 6, "temperature": 0,
                                                  "stream": True}) as r:
        lines = [json.loads(l) for l in r.iter_lines() if l]
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert lines[-1]["finish_reason"] == "length"
    assert sum(len(l["token_ids"]) for l in lines) == 6


def test_openai_completion_and_chat_shapes(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]})
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["message"]["role"] == "assistant"
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"


def test_a_model_this_server_does_not_serve_is_openais_404(client):
    """OpenAI's answer for a model id it does not have: a 404 with an error body naming the id and
    the served one; the official client raises NotFoundError. A request without a model is served."""
    import openai

    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}), ("/v1/chat/completions", chat)):
        for stream in (False, True):
            r = client.post(path, json={**body, "model": "nope", "stream": stream})
            assert r.status_code == 404, r.text
            assert r.json() == {"error": {
                "message": "the model 'nope' does not exist here: this server serves 'tiny' (GET /v1/models); "
                           "send \"model\": 'tiny', or leave the field out",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
        assert client.post(path, json=body).status_code == 200  # no model: the served one
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4o' does not exist here"):
        oai.chat.completions.create(model="gpt-4o", **chat)
    assert oai.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_stream_options_include_usage(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hello"}]}) as r:
        events = [l[len("data: "):] for l in r.iter_lines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["prompt_tokens"] > 0


def test_chat_streams_sse_with_done(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 5, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}) as r:
        events = [l[len("data: "):] for l in r.iter_lines() if l.startswith("data: ")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, status, msg", [
    ("/generate", b"not json", 400, "not valid JSON"),
    ("/generate", b"[1, 2]", 400, "must be a JSON object"),
    ("/generate", b"", 400, "request body is empty"),
    ("/generate", {"max_new_tokens": 3}, 400, "field 'prompt' is required: a non-empty string"),
    ("/generate", {"prompt": ""}, 400, "field 'prompt' must be a non-empty string"),
    ("/generate", {"prompt": "x", "stop_token_ids": 0}, 400, "field 'stop_token_ids' must be a list, got 0"),
    ("/generate", {"prompt": "x", "stop_token_ids": {}}, 400, "field 'stop_token_ids' must be a list, got {}"),
    ("/generate", {"prompt": "x", "temprature": 0.5}, 400, "unknown field(s) temprature"),
    ("/generate", {"prompt": "x", "temperature": "hot"}, 400, "field 'temperature' must be a number"),
    ("/generate", {"prompt": "x", "top_p": 0}, 400, "field 'top_p' must be in (0, 1]"),
    ("/generate", {"prompt": "x", "max_new_tokens": 0}, 400, "field 'max_new_tokens' must be an int >= 1"),
    ("/generate", {"prompt": "x", "stop": 5}, 400, "field 'stop' must be a string or a list"),
    ("/generate", {"prompt": "word " * 300, "max_new_tokens": 8}, 400, "exceeds max_seq_len=256"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "field 'n' must be 1"),
    ("/v1/completions", {"prompt": "x", "logprobs": 5}, 400, "field 'logprobs'=5 is not supported"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/chat/completions", {"messages": []}, 400, "field 'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "chat template rejected the messages: unknown role: robot"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400,
     "field 'max_tokens' must be an int >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "field 'tools'=[{"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400,
     "field 'response_format'"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": 3}, 400,
     "field 'stream_options' must be an object"),
    ("/generate", {"prompt": "x", "stream": "yes"}, 400, "field 'stream' must be true or false"),
    ("/generate", {"prompt": "x", "ignore_eos": 1}, 400, "field 'ignore_eos' must be true or false"),
    # JSON may carry a lone surrogate, which no tokenizer takes (it was a 500 with no message)
    ("/generate", b'{"prompt": "ok \\ud800"}', 400,
     "field 'prompt' is not valid Unicode text: a lone surrogate (\\ud800) at character 3"),
    ("/v1/completions", b'{"prompt": "\\udc00x"}', 400, "field 'prompt' is not valid Unicode text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud83d"}]}', 400,
     "field 'messages[0].content' is not valid Unicode text"),
    ("/generate", b'{"prompt": "x", "stop": ["\\ud800"]}', 400, "field 'stop[0]' is not valid Unicode text"),
    ("/generate", {"prompt": "x", "seed": 1 << 70}, 400, "field 'seed' must be None or an int in [0, 2**64)"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "field 'presence_penalty'=0.5 is not supported"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}, 400, "field 'logit_bias'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "field 'messages[0].content' must be a string or a list of text parts, got [{\"type\": \"text\", \"text\": 5}]"),
    # text no context could hold is refused before it is tokenized (max_seq_len=256: 16,384 characters)
    ("/generate", {"prompt": "a" * 16385}, 400,
     "field 'prompt' is 16,385 characters, more than a context of 256 tokens takes (16,384: 64 per token)"),
    ("/v1/completions", {"prompt": "a" * 20000}, 400, "field 'prompt' is 20,000 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 9000}] * 2}, 400,
     "field 'messages' (their content) is 18,000 characters"),
    ("/generate", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, 400, "field 'stop' has 65 strings; at most 64"),
    ("/generate", {"prompt": "x", "stop_token_ids": list(range(1025))}, 400,
     "field 'stop_token_ids' has 1025 ids; at most 1024"),
    # what was sent is quoted, not all of it
    ("/generate", {"prompt": "x", "stop_token_ids": [1] * 5000 + [-1]}, 400, "1, 1... (15,004 characters)"),
    ("/generate", {"prompt": "x", **{f"k{i}": 1 for i in range(12)}}, 400, "unknown field(s) k0, k1, k10, k11, k2"),
    ("/nope", {}, 404, "no route /nope"),
])
def test_bad_requests_get_4xx_with_a_message(client, path, body, status, msg):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert msg in err["message"] and set(err) == {"message", "type", "param", "code"}  # OpenAI's error shape


def test_a_body_larger_than_any_request_needs_is_refused_unread(client):
    """A body beyond what a context of max_seq_len tokens can need (256 * 64 characters at 12
    bytes each, plus 1 MiB) gets a 413 before it is parsed: from its Content-Length, or,
    sent in chunks without one, once that many bytes have come. The replica serves on."""
    big = json.dumps({"prompt": "a" * 1_300_000}).encode()
    r = client.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"] == (
        f"request body is {len(big):,} bytes, more than a request for a context of 256 tokens "
        "can need (1,245,184); shorten it")

    def pieces():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = client.post("/v1/completions", content=pieces(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "more than 1,245,184 bytes" in r.json()["error"]["message"], r.text
    # just below the limit, a body is read and judged on what it says
    r = client.post("/generate", content=json.dumps({"prompt": "a" * 1_200_000}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "1,200,000 characters" in r.json()["error"]["message"], r.text
    assert client.post("/generate", json={"prompt": "hi", "max_new_tokens": 2}).status_code == 200


def test_long_text_is_tokenized_off_the_event_loop_into_the_same_ids(client, server):
    """Text above TOKENIZE_INLINE_CHARS goes through a worker thread (prompt and chat template):
    the engine is handed the same ids, here counted in its refusal of a prompt too long."""
    from deployments.server.responses import TOKENIZE_INLINE_CHARS

    prompt = "word " * 2000
    assert TOKENIZE_INLINE_CHARS < len(prompt) <= 256 * 64
    n = len(server.tokenizer.encode(prompt))
    r = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 4})
    assert r.status_code == 400 and f"prompt ({n} tokens)" in r.json()["error"]["message"], r.text
    msgs = [{"role": "user", "content": prompt}]
    m = len(server.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
    assert r.status_code == 400 and f"prompt ({m} tokens)" in r.json()["error"]["message"], r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": prompt}]})
    assert r.status_code == 400 and "chat template rejected the messages: unknown role: robot" in r.text


def test_a_prompt_the_model_overflows_on_gets_a_500_that_says_so(client, server):
    """NaN/inf logits (here: the prompt's tokens' embeddings are inf) end that request with a
    500 naming the cause and what to do, on /generate and streamed; the replica serves on."""
    import torch

    ids = server.tokenizer.encode("zz")
    emb = server.started.model.model.embed_tokens.weight
    saved = emb[ids].clone()
    ok = client.post("/generate", json={"prompt": "zz", "max_new_tokens": 4, "temperature": 0})
    assert ok.status_code == 200
    try:
        with torch.no_grad():
            emb[ids] = float("inf")
        r = client.post("/generate", json={"prompt": "zz", "max_new_tokens": 4, "temperature": 0})
        assert r.status_code == 500
        assert "not finite" in r.json()["error"]["message"] and "bfloat16" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={"prompt": "zz", "max_tokens": 4, "stream": True}) as s:
            events = [ln[len("data: "):] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"finish_reason"' not in "".join(events)  # no normal end
        err = json.loads(events[-2])["error"]
        assert err["code"] == 500 and "not finite" in err["message"]
        with client.stream("POST", "/generate", json={"prompt": "zz", "max_new_tokens": 4, "stream": True}) as s:
            last = json.loads(list(s.iter_lines())[-1])
        assert last["finish_reason"] == "error" and "not finite" in last["error"]["message"]
        import openai  # the official client raises on the error event, as on the 500
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client, max_retries=0)
        with pytest.raises(openai.APIError, match="not finite"):
            list(oai.completions.create(model="tiny", prompt="zz", max_tokens=4, stream=True))
        with pytest.raises(openai.InternalServerError, match="not finite"):
            oai.completions.create(model="tiny", prompt="zz", max_tokens=4)
    finally:
        with torch.no_grad():
            emb[ids] = saved
    again = client.post("/generate", json={"prompt": "zz", "max_new_tokens": 4, "temperature": 0})
    assert again.status_code == 200 and again.json()["token_ids"] == ok.json()["token_ids"]


def test_a_request_the_replica_stops_under_gets_a_503(tiny_packed):
    """A replica that stops (its engine shut down) while a request generates: the client gets a
    503 with Retry-After, not a 200 with a truncated answer; streamed, an error event."""
    import threading
    import time

    s = LLMServer(str(tiny_packed), engine={"max_slots": 2, "max_seq_len": 1024})

    c = TestClient(build(s))
    try:
        s.reconfigure({"warmup": {"requests": 1}})
        out: dict = {}

        def ask(kind: str, **kw) -> None:
            if kind == "plain":
                out[kind] = c.post("/generate", json={"prompt": "go", "max_new_tokens": 1000, "ignore_eos": True})
            else:
                with c.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "go"}], "max_tokens": 1000, "stream": True,
                        "ignore_eos": True}) as r:
                    out[kind] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        threads = [threading.Thread(target=ask, args=(k,)) for k in ("plain", "stream")]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while s.engine.stats()["running"] < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert s.engine.stats()["running"] == 2, "both requests should be generating when the replica stops"
        s.shutdown()
        for t in threads:
            t.join(timeout=30)
        r = out["plain"]
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "replica stopped before the generation finished" in r.json()["error"]["message"]
        err = json.loads(out["stream"][-2][len("data: "):])["error"]
        assert err["code"] == 503 and "retry" in err["message"]
        assert s.metrics.requests["stopped"] == 2  # counted apart from "ok" (the dashboard's error ratio)
        # a request that comes after: a 503 with Retry-After, counted once, as "stopped" (not a bad request)
        r = c.post("/generate", json={"prompt": "go", "max_new_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "engine loop is not running" in r.json()["error"]["message"]
        assert dict(s.metrics.requests) == {"stopped": 3}
    finally:
        s.shutdown()


def test_a_fault_of_the_server_itself_is_a_500_that_says_so_and_the_replica_goes_on(client, server, monkeypatch):
    """An exception no handler expects (a bug: here the tokenizer raising) ends that request
    with a JSON 500 naming it, counted as an error; the next request is served."""
    before = server.metrics.requests.get("error", 0)

    def broken(prompt: str) -> list[int]:
        raise TypeError("encode broke")
    monkeypatch.setattr(server.tokenizer, "encode", broken)
    r = client.post("/generate", json={"prompt": "hi", "max_new_tokens": 2})
    assert r.status_code == 500 and r.headers["x-coldstart-replica"]
    assert "internal error (TypeError: encode broke)" in r.json()["error"]["message"]
    assert server.metrics.requests["error"] == before + 1
    monkeypatch.undo()
    assert client.post("/generate", json={"prompt": "hi", "max_new_tokens": 2}).status_code == 200


def test_a_request_without_a_length_limit_gets_the_room_its_prompt_leaves(client, server):
    """max_seq_len=256: a prompt that leaves less room than the route's default length (128,
    16, 256) gets that room when it sends no limit, and the 400 when it sends one."""
    prompt = "word " * 50
    n = len(server.tokenizer.encode(prompt))
    assert 256 - 128 < n < 256
    r = client.post("/generate", json={"prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["finish_reason"] == "length" and len(r.json()["token_ids"]) == 256 - n
    r = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 128})
    assert r.status_code == 400 and "exceeds max_seq_len=256" in r.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})
    assert chat.status_code == 200, chat.text
    u = chat.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] <= 256
    r = client.post("/generate", json={"prompt": "word " * 300})  # no room at all: still the 400
    assert r.status_code == 400 and "exceeds max_seq_len=256" in r.json()["error"]["message"]


def test_wrong_method(client):
    r = client.get("/generate")
    assert r.status_code == 405 and "use POST" in r.json()["error"]["message"]


def test_stats_count_requests(client):
    before = client.get("/stats").json()["requests"].get("bad_request", 0)
    client.post("/generate", json={})
    after = client.get("/stats").json()
    assert after["requests"]["bad_request"] == before + 1
    assert after["warm"] is True and "ttft" in after["last_request"]


def test_a_tiny_temperature_is_greedy_not_token_zero(client):
    """temperature 1e-300 overflowed float32 and returned token 0 repeated; below 1e-5 it is greedy."""
    greedy = client.post("/generate", json={"prompt": "The answer is ", "max_new_tokens": 16, "temperature": 0})
    for t in (1e-300, 1e-40, 1e-6):
        r = client.post("/generate", json={"prompt": "The answer is ", "max_new_tokens": 16, "temperature": t})
        assert r.status_code == 200 and r.json()["token_ids"] == greedy.json()["token_ids"], t


def test_the_same_tokens_make_a_body_of_the_same_length(client):
    """ab's load test counts a body of another length as a failure: timings are headers, not body."""
    bodies = [client.post("/generate", json={"prompt": "The answer is ", "max_new_tokens": 32, "temperature": 0})
              for _ in range(3)]
    assert len({r.content for r in bodies}) == 1
    assert all(0 < float(r.headers["x-coldstart-ttft-s"]) <= float(r.headers["x-coldstart-engine-s"])
               < float(r.headers["x-coldstart-route-s"]) for r in bodies)


def test_openai_routes_name_the_length_field_the_client_sent(client, server):
    prompt = "word " * 100
    n = len(server.tokenizer.encode(prompt))
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 250})
    assert r.status_code == 400 and f"prompt ({n} tokens) + max_tokens (250)" in r.json()["error"]["message"], r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                  "max_completion_tokens": 250})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_completion_tokens (250)" in msg and "max_new_tokens" not in msg, r.text


def test_a_404_quotes_at_most_200_characters_of_the_path(client):
    r = client.get("/" + "x" * 5000)
    msg = r.json()["error"]["message"]
    assert r.status_code == 404 and "(5,001 characters)" in msg and len(msg) < 400


def test_head_health_answers_as_load_balancers_expect(client, tiny_packed):
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""
    cold = LLMServer(str(tiny_packed), engine={"max_slots": 2, "max_seq_len": 128})
    try:
        assert TestClient(build(cold)).head("/health").status_code == 503
    finally:
        cold.shutdown()


def test_a_warming_replica_answers_503_counted_once(tiny_packed):
    """A request to a replica not yet warm: a 503 with Retry-After, counted once, as not_warm."""
    cold = LLMServer(str(tiny_packed), engine={"max_slots": 2, "max_seq_len": 128})
    try:
        c = TestClient(build(cold))
        for path, body in (("/generate", {"prompt": "hi"}), ("/v1/completions", {"prompt": "hi"})):
            r = c.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
            assert r.json()["error"]["message"] == "replica is warming up; retry shortly"
        assert dict(cold.metrics.requests) == {"not_warm": 2}
    finally:
        cold.shutdown()


def test_the_api_is_described_by_its_openapi_document(client, server):
    import warnings
    with warnings.catch_warnings(record=True) as caught:  # FastAPI warns of operation ids used twice
        warnings.simplefilter("always")
        doc = TestClient(build(server)).get("/openapi.json").json()
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
    body = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["prompt"] and "max_new_tokens" in body["properties"]
    assert "/v1/chat/completions" in doc["paths"] and set(doc["paths"]["/health"]) == {"get", "head"}
    ids = [op["operationId"] for path in doc["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), ids


def test_docs_load_their_scripts_from_the_replica_not_a_cdn(client):
    import re
    page = client.get("/docs")
    assert page.status_code == 200 and "/openapi.json" in page.text
    links = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(links) == ["/docs/assets/favicon-32x32.png", "/docs/assets/swagger-ui-bundle.js",
                             "/docs/assets/swagger-ui.css"], links
    for link in links:
        r = client.get(link)
        assert r.status_code == 200 and len(r.content) > 500, link
    assert "SwaggerUIBundle" in client.get("/docs/assets/swagger-ui-bundle.js").text
    # under a route prefix (Ray's proxy sets it as the root path) the links take it
    prefixed = TestClient(client.app, root_path="/app").get("/docs").text
    assert 'src="/app/docs/assets/swagger-ui-bundle.js"' in prefixed and "'/app/openapi.json'" in prefixed
    r = client.get("/docs/assets/index.html")
    assert r.status_code == 404 and "no route /docs/assets/index.html" in r.json()["error"]["message"]


def test_a_fault_inside_a_stream_still_ends_it_with_its_marker(client, monkeypatch):
    """A bug that raises while a stream is under way (here: rendering its second chunk) ends the
    stream with an error event and [DONE] (NDJSON: a last line with finish_reason "error"), not
    with a cut connection a client would read as a normal end."""
    from deployments.server import api

    real, calls = api.completion_chunk, []

    def broken(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("render broke")
        return real(*a, **k)
    monkeypatch.setattr(api, "completion_chunk", broken)
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": True,
                                                       "temperature": 0, "ignore_eos": True}) as s:
        events = [ln[len("data: "):] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and "render broke" in json.loads(events[-2])["error"]["message"]
    monkeypatch.undo()
    assert client.post("/generate", json={"prompt": "hi", "max_new_tokens": 2}).status_code == 200


def test_without_the_proxy_in_front_a_stalled_body_gets_the_replicas_408(server, client, monkeypatch):
    """The replica's own body deadline (args.http.body_timeout_s), for a front that hands it
    requests before their bodies (Ray's proxy without deployments.server.proxy), on real
    sockets: stalled clients get a 408 and are counted as bad requests, one that hangs up while
    sending is counted as cancelled, and requests beside them are served."""
    from helpers_http import response, serving, stalled

    monkeypatch.setattr(server.args.http, "body_timeout_s", 1.0)
    before = dict(server.metrics.requests)
    with serving(build(server)) as port:
        socks = [stalled(port, "/generate", sent=b'{"prompt": "x"') for _ in range(5)]
        try:
            import httpx
            r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"prompt": "hi", "max_new_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
            answers = [response(s) for s in socks]
        finally:
            for s in socks:
                s.close()
        hung = stalled(port, "/generate", declared=1000, sent=b'{"prompt": "x')
        hung.close()
        import time
        deadline = time.time() + 30
        while server.metrics.requests.get("cancelled", 0) == before.get("cancelled", 0) and time.time() < deadline:
            time.sleep(0.05)
    assert {status for status, _, _ in answers} == {408}
    assert b"request body not received within 1 s (14 bytes came)" in answers[0][2]
    after = server.metrics.requests
    assert after["bad_request"] - before.get("bad_request", 0) == 5
    assert after["cancelled"] - before.get("cancelled", 0) == 1
