"""A fast local source for the remote-model benchmarks: a directory over HTTP/1.1 with range
requests, from several processes sharing one port (SO_REUSEPORT), each answer sent with
``sendfile`` from the page cache.

It answers plain HTTP URLs (``http://127.0.0.1:PORT/path``) and, for reading, S3's path-style
requests (``GET``/``HEAD /bucket/key`` with a ``Range`` header), without checking signatures:
a stand-in for an object store's data path, fast enough (many GB/s on one host) that a client
measured against it measures the client.

    python bench/file_server.py ROOT --port 9000 --procs 16
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root = Path(".")

    def log_message(self, *args) -> None:
        pass

    def _resolve(self) -> Path | None:
        rel = os.path.normpath(self.path.split("?", 1)[0].lstrip("/"))
        if rel.startswith("..") or os.path.isabs(rel):
            return None
        p = self.root / rel  # (links inside the root are followed: the benchmark links the model in)
        return p if p.is_file() else None

    def _head(self, p: Path, lo: int, hi: int, size: int, ranged: bool) -> None:
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(hi - lo + 1 if size else 0))
        if ranged:
            self.send_header("Content-Range", f"bytes {lo}-{hi}/{size}")
        st = p.stat()
        self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
        self.send_header("ETag", f'"{st.st_mtime_ns:x}-{size:x}"')
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def _missing(self) -> None:
        body = b"<Error><Code>NoSuchKey</Code></Error>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        p = self._resolve()
        if p is None:
            return self._missing()
        size = p.stat().st_size
        self._head(p, 0, size - 1, size, False)

    def do_GET(self) -> None:
        p = self._resolve()
        if p is None:
            return self._missing()
        size = p.stat().st_size
        lo, hi, rng = 0, size - 1, self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            lo = int(a) if a else max(0, size - int(b))
            hi = min(int(b), size - 1) if (a and b) else size - 1
        self._head(p, lo, hi, size, bool(rng))
        self.wfile.flush()
        with open(p, "rb") as f:
            off, left = lo, hi - lo + 1
            while left > 0:
                n = os.sendfile(self.connection.fileno(), f.fileno(), off, left)
                if n == 0:
                    break
                off += n
                left -= n


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--procs", type=int, default=16)
    a = ap.parse_args()
    Handler.root = Path(a.root).resolve()
    kids = []
    for _ in range(a.procs):
        pid = os.fork()
        if pid == 0:
            Server(("127.0.0.1", a.port), Handler).serve_forever()
            os._exit(0)
        kids.append(pid)
    print(f"serving {Handler.root} on 127.0.0.1:{a.port} from {a.procs} processes", flush=True)

    def stop(*_):
        for k in kids:
            os.kill(k, signal.SIGTERM)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for _ in kids:
        os.wait()


if __name__ == "__main__":
    main()
