"""An ASGI app served by a real uvicorn on 127.0.0.1 in a thread, and raw-socket clients for it:
what a client that stalls or hangs up does is only seen on a real connection."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator


@contextlib.contextmanager
def serving(app: Any) -> Iterator[int]:
    """``app`` on a free port of 127.0.0.1 (yielded) until the block ends."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def stalled(port: int, path: str, declared: int = 100, sent: bytes = b"", chunked: bool = False) -> socket.socket:
    """A client that sends its headers (and ``sent`` of a body of ``declared`` bytes, or of a
    chunked body), then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    length = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {declared}".encode()
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + length + b"\r\n\r\n" + sent)
    return s


def response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case names) and the body so far of the answer on ``s``."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = s.recv(65536)
        if not piece:
            break
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", len(rest)))
    while len(rest) < n:
        piece = s.recv(65536)
        if not piece:
            break
        rest += piece
    return int(lines[0].split(" ", 2)[1]), headers, rest
