"""A fast local source for the remote-model benchmarks: a directory over HTTP/1.1 with range
requests, from several processes sharing one port (SO_REUSEPORT), each answer sent with
``sendfile`` from the page cache.

It answers plain HTTP URLs (``http://127.0.0.1:PORT/path``) and, for reading, S3's path-style
requests (``GET``/``HEAD /bucket/key`` with a ``Range`` header), without checking signatures:
a stand-in for an object store's data path, fast enough (many GB/s on one host) that a client
measured against it measures the client.

    python bench/file_server.py ROOT --port 9000 --procs 16
    python bench/file_server.py ROOT --port 9000 --procs 1 --latency-ms 20 --egress-mbps 300

``--latency-ms`` and ``--egress-mbps`` make it an object store's stand-in where the store is the
limit: every answer's first byte waits that long, and each process's answers together leave at
most that rate (paced in 1 MiB slices; with several processes, each has the rate).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Pace:
    """One process's egress limit: each slice is sent once its turn at ``rate`` bytes a second is over."""

    def __init__(self, rate: float):
        self.rate, self.free_at, self.lock = rate, 0.0, threading.Lock()

    def wait(self, n: int) -> None:
        """Until ``n`` more bytes may have left: the end of their turn at the rate."""
        with self.lock:
            self.free_at = max(time.monotonic(), self.free_at) + n / self.rate
            until = self.free_at
        time.sleep(max(0.0, until - time.monotonic()))


class Handler(BaseHTTPRequestHandler):
    # headers and body leave in separate sends: with Nagle's algorithm on, a small answer's body
    # waits for the client's delayed ACK of the headers (~40 ms a request), as no object store's does
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"
    root = Path(".")
    latency_s = 0.0
    pace: Pace | None = None

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
        if self.latency_s:
            time.sleep(self.latency_s)
        self._head(p, lo, hi, size, bool(rng))
        self.wfile.flush()
        with open(p, "rb") as f:
            off, left = lo, hi - lo + 1
            while left > 0:
                step = left if self.pace is None else min(left, 1 << 20)
                if self.pace is not None:
                    self.pace.wait(step)
                n = os.sendfile(self.connection.fileno(), f.fileno(), off, step)
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
    ap.add_argument("--latency-ms", type=float, default=0.0, help="each answer's first byte waits this long")
    ap.add_argument("--egress-mbps", type=float, default=0.0, help="each process's answers together, MB/s (0: no limit)")
    a = ap.parse_args()
    Handler.root = Path(a.root).resolve()
    Handler.latency_s = a.latency_ms / 1e3
    Handler.pace = Pace(a.egress_mbps * 1e6) if a.egress_mbps > 0 else None
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
