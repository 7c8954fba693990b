"""A plain HTTP server of a directory with range requests, and faults on demand: the tests' remote
source that is not S3 (``https://host/path`` models) and a wire that changes or drops bytes.

    python tests/range_server.py ROOT PORT

Control (JSON, POST /_fault): {"corrupt": N} flips one byte in the next N answers that carry data
of a model.cst's data region; {"corrupt": -1} in every one; {"die_after": BYTES} ends the process
once that many bytes of model.cst have been sent (mid-answer: the source vanishes); {"delay_s": S}
waits S seconds before each ranged answer; {"ignore_range": true} answers every GET with the whole
file (200), as a server without range requests does. GET /_stats: bytes sent per file.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
STATE = {"corrupt": 0, "die_after": None, "delay_s": 0.0, "ignore_range": False, "sent": {}, "weights_sent": 0}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # (headers and body are separate sends: no delayed-ACK wait between)

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, code: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if self.path != "/_fault":
            return self._json(404, {"error": "no such path"})
        doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with LOCK:
            STATE.update({k: v for k, v in doc.items() if k in ("corrupt", "die_after", "delay_s", "ignore_range")})
        self._json(200, {"ok": True})

    def _file(self) -> Path | None:
        rel = self.path.split("?", 1)[0].lstrip("/")
        p = (ROOT / rel).resolve()
        if ROOT.resolve() not in p.parents or not p.is_file():
            return None
        return p

    def do_HEAD(self) -> None:
        p = self._file()
        if p is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(p.stat().st_size))
        self.send_header("Last-Modified", self.date_time_string(int(p.stat().st_mtime)))
        self.send_header("ETag", f'"{p.stat().st_mtime_ns:x}-{p.stat().st_size:x}"')
        self.end_headers()

    def do_GET(self) -> None:
        if self.path == "/_stats":
            with LOCK:
                return self._json(200, {"sent": STATE["sent"], "weights_sent": STATE["weights_sent"]})
        p = self._file()
        if p is None:
            body = b"not found"
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        size = p.stat().st_size
        lo, hi = 0, size - 1
        rng = None if STATE["ignore_range"] else self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            lo = int(a) if a else size - int(b)
            hi = min(int(b), size - 1) if (a and b) else size - 1
        with open(p, "rb") as f:
            f.seek(lo)
            data = bytearray(f.read(hi - lo + 1))
        weights = p.name == "model.cst"
        with LOCK:
            delay = STATE["delay_s"]
            if weights and lo >= 4096 and len(data) > 4096 and STATE["corrupt"]:
                data[len(data) // 2] ^= 0x40
                if STATE["corrupt"] > 0:
                    STATE["corrupt"] -= 1
        if delay and rng:
            time.sleep(delay)
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(len(data)))
        if rng:
            self.send_header("Content-Range", f"bytes {lo}-{hi}/{size}")
        self.send_header("Last-Modified", self.date_time_string(int(p.stat().st_mtime)))
        self.send_header("ETag", f'"{p.stat().st_mtime_ns:x}-{size:x}"')
        self.end_headers()
        sent = 0
        for off in range(0, len(data), 1 << 16):
            piece = bytes(data[off:off + (1 << 16)])
            with LOCK:
                die = STATE["die_after"]
                if weights and die is not None and STATE["weights_sent"] + len(piece) > die:
                    self.wfile.flush()
                    os._exit(3)  # the source vanishes mid-answer
                if weights:
                    STATE["weights_sent"] += len(piece)
                rel = p.relative_to(ROOT.resolve()).as_posix()
                STATE["sent"][rel] = STATE["sent"].get(rel, 0) + len(piece)
            self.wfile.write(piece)
            sent += len(piece)


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()
