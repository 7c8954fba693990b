"""deployments.server.proxy: what runs in Ray Serve's HTTP proxy, on a real uvicorn and real
sockets, in front of a small app standing for the proxy's routing (the whole of it, through
Ray: test_serve.py)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from deployments.server.proxy import BodyFirst, middlewares
from helpers_http import response, serving, stalled


class Routed:
    """The app behind the middleware: records what reached it; /busy answers 503 as Ray's proxy
    does for a deployment over its queue (no Retry-After), /busy-own a 503 with its own."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        if scope["method"] == "POST":
            while True:
                m = await receive()
                body += m.get("body", b"")
                if not m.get("more_body"):
                    break
        self.seen.append((scope["path"], body))
        status = 503 if scope["path"].startswith("/busy") else 200
        headers = [(b"retry-after", b"1")] if scope["path"] == "/busy-own" else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps({"bytes": len(body)}).encode()})


@pytest.fixture
def proxy():
    app, counted = Routed(), []
    with serving(BodyFirst(app, timeout_s=1.0, max_bytes=1000, count=counted.append)) as port:
        yield app, counted, port


def test_a_stalled_body_never_reaches_the_app_and_gets_a_408(proxy):
    """50 clients send their headers and part of a body, then nothing: others are served
    meanwhile, the stalled ones get a 408 each and never reach the routing behind."""
    app, counted, port = proxy
    socks = [stalled(port, "/generate", sent=b'{"prompt": "x"') for _ in range(50)]
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 200 and r.json() == {"bytes": len(b'{"prompt":"hi"}')}
        answers = [response(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert {status for status, _, _ in answers} == {408}
    status, headers, body = answers[0]
    assert headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["message"] == "request body not received within 1 s (14 bytes came); send it at once"
    assert err["code"] == 408 and err["type"] == "invalid_request_error"
    assert [p for p, _ in app.seen] == ["/generate"] and counted == ["408"] * 50


def test_a_body_too_large_is_refused_unread_declared_or_chunked(proxy):
    app, counted, port = proxy
    r = httpx.post(f"http://127.0.0.1:{port}/generate", content=b"x" * 1001, timeout=30)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"] == "request body is 1,001 bytes, more than this server takes (1,000); shorten it"
    r = httpx.post(f"http://127.0.0.1:{port}/generate", content=iter([b"x" * 600, b"x" * 600]), timeout=30)
    assert r.status_code == 413 and "more than 1,000 bytes" in r.json()["error"]["message"], r.text
    assert app.seen == [] and counted == ["413", "413"]


def test_whole_bodies_chunked_or_not_and_bodiless_requests_go_through(proxy):
    app, counted, port = proxy
    base = f"http://127.0.0.1:{port}"
    assert httpx.post(base + "/a", content=b"y" * 1000, timeout=30).json() == {"bytes": 1000}
    assert httpx.post(base + "/b", content=iter([b"ab", b"", b"cd"]), timeout=30).json() == {"bytes": 4}
    assert httpx.get(base + "/c", timeout=30).status_code == 200
    assert httpx.post(base + "/d", timeout=30).json() == {"bytes": 0}
    assert app.seen == [("/a", b"y" * 1000), ("/b", b"abcd"), ("/c", b""), ("/d", b"")] and counted == []


def test_a_503_gets_a_retry_after_and_keeps_its_own(proxy):
    app, counted, port = proxy
    r = httpx.post(f"http://127.0.0.1:{port}/busy", json={}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    r = httpx.get(f"http://127.0.0.1:{port}/busy-own", timeout=30)
    assert r.status_code == 503 and r.headers.get_list("retry-after") == ["1"]
    assert httpx.get(f"http://127.0.0.1:{port}/fine", timeout=30).headers.get("retry-after") is None


def test_a_client_that_hangs_up_while_sending_is_forgotten(proxy):
    app, counted, port = proxy
    s = stalled(port, "/generate", declared=1000, sent=b'{"prompt": "x')
    time.sleep(0.2)
    s.shutdown(socket.SHUT_RDWR)
    s.close()
    deadline = time.time() + 30
    while not counted and time.time() < deadline:
        time.sleep(0.05)
    assert counted == ["disconnected"] and app.seen == []


def test_the_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("COLDSTART_PROXY_BODY_TIMEOUT_S", "2.5")
    monkeypatch.setenv("COLDSTART_PROXY_MAX_BODY_BYTES", "4096")
    (mw,) = middlewares()
    assert mw.cls is BodyFirst and (mw.kwargs["timeout_s"], mw.kwargs["max_bytes"]) == (2.5, 4096)
    monkeypatch.setenv("COLDSTART_PROXY_BODY_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match=r"COLDSTART_PROXY_BODY_TIMEOUT_S='0': give a number of seconds above 0"):
        middlewares()
    monkeypatch.setenv("COLDSTART_PROXY_BODY_TIMEOUT_S", "3")
    monkeypatch.setenv("COLDSTART_PROXY_MAX_BODY_BYTES", "16M")
    with pytest.raises(ValueError, match=r"COLDSTART_PROXY_MAX_BODY_BYTES='16M': give a whole number of bytes"):
        middlewares()
