"""Real remote sources for the tests: an S3-speaking server (moto in server mode, its own process,
spoken to over HTTP) and a plain HTTP range server with faults (``tests/range_server.py``), both
on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
S3_ENV = {"AWS_ACCESS_KEY_ID": "coldstart-test", "AWS_SECRET_ACCESS_KEY": "coldstart-test-secret",
          "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it answered")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (an error status is an answer)
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout} s")


@contextlib.contextmanager
def s3_server(log: Path) -> Iterator[str]:
    """moto's S3 server on a free port; yields its endpoint URL. Sets the AWS variables in this
    process's environment (the clients, and Ray nodes started afterwards, read them there)."""
    exe = Path(sys.executable).with_name("moto_server")
    port = free_port()
    cmd = [str(exe) if exe.exists() else shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1",
           "-p", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    old = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=url)
    try:
        _wait_up(url, proc, "moto_server")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_bucket(name: str) -> None:
    import boto3
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)


class RangeServer:
    """``tests/range_server.py`` over ``root``: start, fault, stats, kill."""

    def __init__(self, root: Path, log: Path):
        self.root, self.log, self.port = root, log, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RangeServer":
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "range_server.py"), str(self.root),
                                          str(self.port)], stdout=out, stderr=subprocess.STDOUT)
        _wait_up(self.url + "/_stats", self.proc, "range_server")
        return self

    def fault(self, **kw) -> None:
        req = urllib.request.Request(self.url + "/_fault", data=json.dumps(kw).encode(), method="POST")
        urllib.request.urlopen(req, timeout=5).close()

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/_stats", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=30)


def no_partials(root: Path) -> list[Path]:
    """Every temporary transfer file or directory under a node cache (should be none after a failure)."""
    return [p for p in root.rglob("*") if ".partial-" in p.name]
