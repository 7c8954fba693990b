"""A packed model in object storage: its address, the store that reads it, and the upload.

A packed model directory (``weights.format``) can live under a URI instead of on the node's disk::

    s3://bucket/prefix/llama-2-7b     the S3 API: AWS, MinIO, Ceph, GCS's interoperability endpoint
    gs://bucket/prefix/llama-2-7b     Google Cloud Storage
    https://host/path/llama-2-7b      plain HTTP(S) with range requests (read only)

The files under it are the directory's own, by the same relative names (``model.cst``,
``config.json``, ``kernels/...``, ``tp.json`` and ``rank-K/model.cst`` for a split pack), so
``coldstart push DIR URI`` is a copy and a copy made by any other tool serves as well.

Reads go through obstore (Rust's ``object_store``), which holds the credentials, signs and
answers every request but one kind: a big file's ranged GETs, the bulk of a transfer, are read
by the standard library's HTTP client straight into the caller's buffer (a pinned staging slot),
from a URL obstore signs (``obstore.sign``; a plain HTTP(S) model's own URL). obstore returns
each answer as a new buffer of its own, which a reader then copies: on a host where the source
is fast that copy, and the fresh pages under it, cost the transfer more than the reads
(``_Direct``). Where obstore cannot sign (a store or credential without signing), a proxy is set
for the host, or the source answers a signed URL with an error (a bucket policy that allows
signed headers only), its own ranged GETs read (and the copy stays). Credentials come from wherever
that library looks for them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``,
web identity, the instance's role; ``GOOGLE_APPLICATION_CREDENTIALS``), never from coldstart's
own configuration, and a URI that carries a secret (``user:password@``, ``?X-Amz-...``) is refused.
Messages name the URI and the file, never a credential.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import socket
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import SplitResult, urlsplit

log = logging.getLogger(__name__)

SCHEMES = ("s3", "gs", "http", "https")
_SECRET_QUERY = re.compile(r"(?i)(x-amz-|signature|credential|token|key)")


class RemoteError(OSError):
    """A remote source failed: unreachable, refused, missing a file, or too slow. The message names
    the source (its URI) and the file, and says what to do."""


class RemoteNotFound(RemoteError):
    """The source answered that the file is not there."""


def is_remote(model: str | os.PathLike) -> bool:
    """Whether ``model`` names a packed model in object storage or on an HTTP(S) server."""
    return isinstance(model, str) and urlsplit(model).scheme in SCHEMES


def check_uri(uri: str) -> str:
    """``uri`` without a trailing slash; ValueError for an unknown scheme, a missing bucket or
    path, or a secret written into the URI (credentials belong where the client reads them)."""
    u = urlsplit(uri)
    if u.scheme not in SCHEMES:
        raise ValueError(f"{uri!r}: a remote packed model is s3://, gs://, http:// or https://")
    if not u.netloc or not u.path.strip("/"):
        raise ValueError(f"{uri!r}: name the bucket (or host) and the packed model's path under it, "
                         "e.g. s3://models/llama-2-7b")
    if u.password or _SECRET_QUERY.search(u.query or ""):
        raise ValueError(f"{u.scheme}://{u.hostname}{u.path}: the URI carries a credential; remove it "
                         "and give credentials where the client reads them (AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, an instance role, GOOGLE_APPLICATION_CREDENTIALS)")
    return uri.rstrip("/")


def model_name(uri: str) -> str:
    """The packed model's name: the last component of its path (its directory's name on disk)."""
    return urlsplit(uri).path.rstrip("/").rsplit("/", 1)[-1]


def _short(e: BaseException) -> str:
    """The first line of a client error (obstore appends a multi-line debug dump)."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


@dataclass(frozen=True)
class Timeouts:
    """How long a remote read may take before it counts as failed (and another source is tried)."""

    connect_s: float = 5.0
    request_s: float = 60.0  # one ranged GET of a piece (16 MiB at 0.3 MB/s)
    retries: int = 2


class Origin:
    """The store a packed model's URI names: small files whole, big ones by ranges.

    Thread-safe: obstore's store is shared by every reader thread."""

    def __init__(self, uri: str, timeouts: Timeouts = Timeouts()):
        self.uri = check_uri(uri)
        self.name = self.uri
        self.timeouts = timeouts
        self._store = _open_store(self.uri, timeouts)
        self._direct = _Direct.make(self.uri, self._store, timeouts)

    def __repr__(self) -> str:
        return f"Origin({self.uri})"

    def _fail(self, rel: str, e: BaseException, what: str) -> RemoteError:
        if isinstance(e, FileNotFoundError):
            return RemoteNotFound(f"{self.uri}/{rel}: not found at the source; is the URI right, and was the "
                               "model pushed whole (`coldstart push DIR URI`)?")
        first = _short(e)
        hint = ("check the endpoint and credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) and that the "
                "server is up")
        refused = type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError")  # (obstore's types)
        if refused or isinstance(e, PermissionError) or re.search(r"\b40[13] (Forbidden|Unauthorized)", first):
            hint = "the credentials were refused: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the role"
        elif isinstance(e, TimeoutError) or "kind: Timeout" in str(e) or "TimedOut" in str(e):  # (obstore's dump)
            hint = ("the source answered too slowly: check the network to it, or raise load.remote_timeout_s "
                    f"(now {self.timeouts.request_s:g} s a request)")
        return RemoteError(f"{self.uri}/{rel}: {what} failed ({_short(e)}); {hint}")

    def size(self, rel: str) -> int:
        import obstore
        try:
            return int(obstore.head(self._store, rel)["size"])
        except Exception as e:  # obstore raises its own error types (subclasses of OSError and others)
            raise self._fail(rel, e, "HEAD") from None

    def exists(self, rel: str) -> bool:
        try:
            self.size(rel)
        except RemoteNotFound:
            return False
        return True

    def get(self, rel: str) -> bytes:
        """A whole (small) file."""
        import obstore
        try:
            return bytes(obstore.get(self._store, rel).bytes())
        except Exception as e:
            raise self._fail(rel, e, "GET") from None

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the file's bytes from ``offset``; a short answer is an error."""
        if self._direct is not None and self._direct.read_into(rel, offset, view, self._fail):
            return
        import obstore
        n = len(view)
        try:
            got = obstore.get_range(self._store, rel, start=offset, length=n)
        except Exception as e:
            raise self._fail(rel, e, f"ranged GET of bytes {offset}..{offset + n}") from None
        m = memoryview(got)
        if len(m) != n:
            raise RemoteError(f"{self.uri}/{rel}: asked for {n} bytes at {offset}, got {len(m)}: the file "
                              "changed or was truncated at the source; push it again")
        copy_into(view, m)

    def list(self, rel_prefix: str) -> list[str]:
        """Relative names of the files under ``rel_prefix`` (empty where the store cannot list: HTTP)."""
        import obstore
        if urlsplit(self.uri).scheme in ("http", "https"):
            return []
        try:
            out = []
            for batch in obstore.list(self._store, prefix=rel_prefix):
                out += [m["path"] for m in batch]
            return sorted(out)
        except Exception as e:
            raise self._fail(rel_prefix, e, "LIST") from None

    def put(self, rel: str, path: Path) -> None:
        import obstore
        try:
            obstore.put(self._store, rel, path)
        except Exception as e:
            raise self._fail(rel, e, "PUT") from None


class _HTTPStatus(OSError):
    """A ranged GET answered with a status other than the range (the message keeps no URL)."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status} {reason}")
        self.status = status


class _Direct:
    """An origin's ranged GETs read straight into the caller's buffer: ``http.client``'s
    ``readinto`` receives the socket's bytes where they are wanted. One keep-alive connection per
    reader thread and host; a signed URL per file, signed again before it expires. The URL's query
    (its signature) appears in no message."""

    SIGNED_FOR = timedelta(hours=1)
    RESIGN_AFTER_S = 1800.0

    def __init__(self, uri: str, store: Any, timeouts: Timeouts):
        self.uri, self.store, self.timeouts = uri, store, timeouts
        self.usable = True  # False once a URL could not be signed or was refused: obstore's GETs read
        self._signed = urlsplit(uri).scheme not in ("http", "https")
        self._urls: dict[str, tuple[float, SplitResult]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._tls: ssl.SSLContext | None = None

    @classmethod
    def make(cls, uri: str, store: Any, timeouts: Timeouts) -> "_Direct | None":
        """None where a proxy is set for the source's host (obstore's client goes through it)."""
        host = urlsplit(uri).hostname or ""
        endpoint = os.environ.get("AWS_ENDPOINT_URL") if urlsplit(uri).scheme == "s3" else None
        if endpoint:
            host = urlsplit(endpoint).hostname or host
        proxies = urllib.request.getproxies()
        if proxies and not urllib.request.proxy_bypass(host):
            return None
        return cls(uri, store, timeouts)

    def _url(self, rel: str) -> SplitResult | None:
        now = time.monotonic()
        with self._lock:
            got = self._urls.get(rel)
            if got is not None and now - got[0] < self.RESIGN_AFTER_S:
                return got[1]
        if self._signed:
            import obstore
            try:
                url = urlsplit(obstore.sign(self.store, "GET", rel, self.SIGNED_FOR))
            except Exception as e:  # noqa: BLE001 - a store or credential that cannot sign: obstore reads
                log.debug("%s: obstore cannot sign a GET (%s); its own ranged GETs read", self.uri, _short(e))
                self.usable = False
                return None
        else:
            url = urlsplit(f"{self.uri}/{rel}")
        with self._lock:
            self._urls[rel] = (now, url)
        return url

    def _connection(self, url: SplitResult) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the URL's host, and whether it served a request before."""
        conns = self._local.__dict__.setdefault("conns", {})
        key = (url.scheme, url.hostname, url.port)
        conn = conns.get(key)
        if conn is not None:
            return conn, True
        if url.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            conn = http.client.HTTPSConnection(url.hostname, url.port, timeout=self.timeouts.connect_s,
                                               context=self._tls)
        else:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.timeouts.connect_s)
        conn.connect()
        conn.sock.settimeout(self.timeouts.request_s)
        conns[key] = conn
        return conn, False

    def _forget(self, url: SplitResult) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((url.scheme, url.hostname, url.port), None)
        if conn is not None:
            conn.close()

    def read_into(self, rel: str, offset: int, view: memoryview,
                  fail: Callable[[str, BaseException, str], RemoteError]) -> bool:
        """Fill ``view`` with ``rel``'s bytes from ``offset`` (``fail`` makes the error, as
        ``Origin``'s own); False where obstore cannot sign or the source refused the signed URL
        (the caller reads through obstore)."""
        url = self._url(rel) if self.usable else None
        if url is None:
            return False
        n = len(view)
        what = f"ranged GET of bytes {offset}..{offset + n}"
        for attempt in (0, 1):
            reused = False
            try:
                conn, reused = self._connection(url)
                self._get(conn, url, rel, offset, view)
                return True
            except _HTTPStatus as e:
                # refused or failed as a signed URL (a bucket policy may allow only signed headers; a
                # server may not take them): obstore's own requests read this origin from now on,
                # and answer for the file (its errors name what went wrong)
                self._forget(url)
                self.usable = False
                log.info("%s/%s: a GET by signed URL was answered %s; obstore's own requests read from now on",
                         self.uri, rel, e)
                return False
            except RemoteError:
                self._forget(url)
                raise
            except (OSError, http.client.HTTPException) as e:
                self._forget(url)
                # a kept-alive connection the server had closed fails at once: asked again on a new one
                if attempt == 0 and reused and isinstance(e, (http.client.RemoteDisconnected, ConnectionError)):
                    continue
                if isinstance(e, socket.timeout):
                    e = TimeoutError(f"no answer within {self.timeouts.request_s:g} s")
                raise fail(rel, e, what) from None

    def _get(self, conn: http.client.HTTPConnection, url: SplitResult, rel: str, offset: int,
             view: memoryview) -> None:
        n = len(view)
        t0 = time.monotonic()
        conn.request("GET", url.path + (f"?{url.query}" if url.query else ""),
                     headers={"Range": f"bytes={offset}-{offset + n - 1}"})
        resp = conn.getresponse()
        if resp.status not in (200, 206):
            resp.read(1 << 16)
            raise _HTTPStatus(resp.status, resp.reason)
        whole = resp.status == 200  # a server that ignores ranges: the file from its start
        start = 0 if whole else int((resp.getheader("Content-Range") or "bytes -1-").split()[1].split("-")[0])
        if start != offset or (resp.length is not None and resp.length < n):
            raise RemoteError(f"{self.uri}/{rel}: asked for {n} bytes at {offset}, the answer holds "
                              f"{resp.length} from {start}: the file changed or was truncated at the "
                              "source, or it ignores range requests; push it again")
        got = 0
        while got < n:
            k = resp.readinto(view[got:])
            if not k:
                raise RemoteError(f"{self.uri}/{rel}: the answer to bytes {offset}..{offset + n} ended after "
                                  f"{got}: the source closed the connection or the file was truncated")
            got += k
            if time.monotonic() - t0 > self.timeouts.request_s:
                raise socket.timeout()
        if not resp.isclosed():  # more than asked for (a whole file; an answer of unknown length): not reused
            self._forget(url)


def copy_into(view: memoryview, src: memoryview) -> None:
    """``view[:] = src`` without holding the GIL for the copy (many reader threads copy at once;
    numpy's copy runs in the calling thread, where torch's would start a thread pool in each)."""
    if len(src) < 1 << 20:
        view[:] = src
        return
    import numpy as np
    np.copyto(np.frombuffer(view, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _open_store(uri: str, t: Timeouts) -> Any:
    try:
        from obstore.store import from_url
    except ImportError:
        raise RemoteError(f"{uri}: reading a remote packed model needs the obstore package "
                          "(`pip install obstore`)") from None
    client = {"connect_timeout": timedelta(seconds=t.connect_s), "timeout": timedelta(seconds=t.request_s)}
    retry = {"max_retries": t.retries, "retry_timeout": timedelta(seconds=t.request_s)}
    scheme = urlsplit(uri).scheme
    if scheme == "http" or os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        client["allow_http"] = True  # a plain-HTTP endpoint (MinIO on a private network, a test server)
    try:
        return from_url(uri, client_options=client, retry_config=retry)
    except Exception as e:
        raise RemoteError(f"{uri}: cannot open the store ({_short(e)}); check the URI and the client's "
                          "settings (AWS_REGION, AWS_ENDPOINT_URL)") from None


def local_files(d: Path) -> Iterator[tuple[str, Path]]:
    """Every file of a packed model directory as (relative name, path), sorted; temporary files
    and leftovers (names starting with a dot) excluded."""
    for root, dirs, files in os.walk(d):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in sorted(files):
            if not f.startswith("."):
                p = Path(root) / f
                yield p.relative_to(d).as_posix(), p


def push(src: str | os.PathLike, uri: str) -> list[str]:
    """Upload the packed model directory ``src`` to ``uri``: every file, the weights last, so a
    reader never finds new weights beside old side files. Checks ``src`` first (structure and
    every chunk: ``weights.verify``). Returns the relative names uploaded."""
    from .verifier import verify
    d = Path(src)
    report = verify(d)
    if not report.ok:
        raise ValueError(f"{d}: not pushed: {report.summary()}")
    origin = Origin(uri)
    files = list(local_files(d))
    weights = [f for f in files if f[0].endswith("model.cst")]
    for rel, p in [f for f in files if f not in weights] + weights:
        log.info("push %s -> %s/%s (%.1f MiB)", p, origin.uri, rel, p.stat().st_size / 2**20)
        origin.put(rel, p)
    return [rel for rel, _ in files]
