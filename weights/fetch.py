"""Bring a remote packed model onto this node: from its peers and its source, into the device
buffer and the node cache in one pass.

``resolve(uri, cache, rank=...)`` reads the source's header (the weight file's preamble and index,
a few KiB) and returns either the local entry (``weights.cache``) that already holds exactly that
model, or a ``Fetch``: the entry made ready (side files checked against the index, the kernel
bundle beside them) and the weight file's transfer to run, holding the entry's lock so that a
second replica on the node waits for this one's transfer instead of starting its own.

A ``Fetch`` moves the data region in pieces of whole chunks. Each piece comes from a *source*:
a peer (another node's cache, ``deployments.peers``) that holds its chunks, spread over the peers
that hold them, least busy first; else the model's origin (object storage or an HTTP server).
Every piece is checked against the index's chunk sums as it lands, before it is copied to the
device or written to the cache's temporary file; a source that fails or sends a corrupt byte is
dropped and the piece fetched from the next one, and the node's own peer service is told of each
piece written (``Peers.announce``), so that nodes starting together pass chunks on to each other.
On a GPU the cache's writes go on behind the device's copies (``Behind``): a file's buffered
writes take its lock one at a time, several times slower than the reads, so they are not let hold
the staging slots the copies need; each piece is copied back from the device buffer once there,
checked again and written, and the GPU's load ends without waiting for the file.
It is told too of the pieces the node is reading from the origin: another node's transfer puts
such a piece off to its end and then takes it from that peer once held (``PieceOrder``), instead
of reading it from the origin a second time.
Only when every piece has landed is the file renamed into place (``commit``); anything else
(``abort``) removes it: a failed transfer never leaves an entry that looks complete.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from .cache import NodeCache, partial_name, publish_file
from .format import (SIDE_FILES, TP_MANIFEST, WEIGHTS_FILE, PackedFile, PackedFormatError,
                     file_sha256, parse_packed, rank_dir)
from .remote import Origin, RemoteError, RemoteNotFound, Timeouts, check_uri, model_name

log = logging.getLogger(__name__)

ALL = None  # a source's holdings when it holds the whole file


class Source(Protocol):
    """Where a piece can come from: a peer's cache or the origin."""

    name: str

    def holds(self, rel: str) -> "set[int] | None":
        """The chunks of ``rel`` this source can serve now (``ALL``: the whole file)."""

    def reading(self, rel: str) -> set[int]:
        """The chunks of ``rel`` this source is reading from the origin now (it will hold them soon)."""

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        """Fill ``view`` with ``rel``'s bytes from file offset ``offset``."""


class Peers(Protocol):
    """The cluster's other nodes, as the fetch sees them (``deployments.peers`` over Ray)."""

    def sources(self, key: str, rel: str) -> list[Source]:
        """Peers that hold some of ``rel`` of entry ``key``, other than this node."""

    def start_piece(self, n_pieces: int) -> int:
        """Where this node's transfer of ``n_pieces`` begins (nodes starting together begin apart)."""

    def announce(self, key: str, rel: str, path: str, chunks: "list[int] | None", reading: list[int],
                 seq: int) -> None:
        """Tell this node's peer service that ``chunks`` of ``rel`` (None: all, the file is
        complete) are checked and readable at ``path``, and that ``reading`` are being read from
        the origin; ``path`` empty: the transfer ended without completing (forget it). ``seq``:
        when this was true (``time.monotonic_ns``); the service keeps the latest, whatever order
        the announcements arrive in."""


class OriginSource:
    """The model's origin as a source: it holds every chunk."""

    def __init__(self, origin: Origin):
        self.origin, self.name = origin, origin.uri

    def holds(self, rel: str) -> None:
        return ALL

    def reading(self, rel: str) -> set[int]:
        return set()

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        self.origin.read_into(rel, offset, view)


@dataclass
class _Stats:
    bytes_from: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    # the reader threads' seconds in each step of a piece, summed over the threads: the sources'
    # answers, the checksums, the writes into the cache file (which step limits the transfer)
    busy_s: dict[str, float] = field(default_factory=lambda: {"read": 0.0, "check": 0.0, "write": 0.0})
    # a device load's reader seconds outside the reads, by what they waited for (weights.stream):
    # pinning their staging slots, a slot's copy to the device, the next piece
    idle_s: dict[str, float] = field(default_factory=lambda: {"pin": 0.0, "slot": 0.0, "next": 0.0})


class Fetch:
    """One weight file's transfer into the node cache (see the module's docstring)."""

    REFRESH_S = 0.5  # how often the peers' holdings are asked again
    ORIGIN_TRIES = 2  # a piece's answers from the origin before the transfer fails

    def __init__(self, *, cache: NodeCache, entry: Path, rel: str, packed: PackedFile, head: bytes,
                 tail: bytes, origin: Origin, peers: Peers | None, key: str, release: Any):
        self.cache, self.entry, self.rel, self.packed, self.key = cache, entry, rel, packed, key
        self.origin, self.peers, self._release = origin, peers, release
        self.final = entry / rel
        self.tmp = self.final.with_name(partial_name(WEIGHTS_FILE))
        self.cb = packed.index.chunk_bytes
        self._sums = packed.index.chunk_sums
        self.stats = _Stats()
        self._lock = threading.Lock()
        self._sources: list[Source] = []
        self._holdings: dict[str, Any] = {}
        self._peer_reading: dict[str, set[int]] = {}  # each peer's chunks in flight from the origin
        self._reading: set[int] = set()  # this node's chunks in flight from the origin
        self._coming: set[int] = set()  # checked, not yet written (``Behind``): held soon, as if being read
        self._sent: dict[int, str] = {}  # each piece's source, by its offset
        self._slowest_s = 0.0  # the longest a piece has taken from the origin so far
        self._busy: dict[str, int] = {}
        self._refreshed = 0.0
        self._refreshing = threading.Lock()  # one reader thread asks the peers at a time
        self._closed = False
        self._ending = threading.Lock()  # commit and abort, one at a time
        self._landed: set[int] = set()
        self.behind: Behind | None = None
        self.committed_at: float | None = None  # perf_counter() when the file took its name
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _allocate(self.fd, packed.file_bytes, self.tmp)
            os.pwrite(self.fd, head, 0)
            os.pwrite(self.fd, tail, packed.data_offset + packed.data_bytes)
        except BaseException:
            self.abort()
            raise
        self._refresh(force=True)

    # ---------------------------------------------------------------- sources
    def _refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._refreshed < self.REFRESH_S:
            return
        if not self._refreshing.acquire(blocking=False):
            return  # another thread is asking them: the holdings known so far serve meanwhile
        try:
            self._refreshed = time.monotonic()
            self._ask_peers()
        finally:
            self._refreshing.release()

    def _ask_peers(self) -> None:
        found: list[Source] = []
        if self.peers is not None:
            try:
                found = [p for p in self.peers.sources(self.key, self.rel) if p.name not in self.stats.dropped]
            except Exception as e:  # the peers' directory is a help, never a reason to fail
                log.info("peers of %s not asked (%s): reading from %s", self.rel, e, self.origin.uri)
        holdings, reading = {}, {}
        for p in found:
            try:
                holdings[p.name], reading[p.name] = p.holds(self.rel), p.reading(self.rel)
            except Exception as e:
                self._drop(p, f"did not answer ({e})")
        with self._lock:
            self._sources = [p for p in found if p.name in holdings]
            self._holdings, self._peer_reading = holdings, reading

    def _drop(self, source: Source, why: str) -> None:
        with self._lock:
            if source.name not in self.stats.dropped:
                self.stats.dropped[source.name] = why
                log.warning("%s: dropped %s as a source of %s: %s; its chunks come from elsewhere",
                            self.entry.name, source.name, self.rel, why)

    # ---------------------------------------------------------------- pieces
    def _chunks(self, off: int, length: int) -> range:
        return range(off // self.cb, -(-(off + length) // self.cb))

    def _wanted_elsewhere(self, chunks: range) -> bool:
        """A peer was reading some of these chunks from the origin at the last refresh, and no
        peer holds them all yet: the piece is better put off and taken from that peer."""
        with self._lock:
            if self._holders(chunks):
                return False
            return any(c in self._peer_reading[p.name] for p in self._sources if p.name not in self.stats.dropped
                       for c in chunks)

    def patience_s(self) -> float:
        """How long a put-off piece waits for the peer reading it: twice the slowest piece from the
        origin so far (a peer's read should take no longer), at least two refreshes; before any
        piece came from the origin, as long as one request to it may take."""
        if not self._slowest_s:
            return self.origin.timeouts.request_s
        return max(2 * self.REFRESH_S, 2 * self._slowest_s)

    def _holders(self, chunks: range) -> list[Source]:
        """The peers, not dropped, that held every one of ``chunks`` at the last refresh (called
        with the lock held)."""
        return [p for p in self._sources if p.name not in self.stats.dropped and
                (self._holdings[p.name] is ALL or all(c in self._holdings[p.name] for c in chunks))]

    def _pick(self, chunks: range, origin_ok: bool) -> Source | None:
        """The least busy peer holding every chunk of the piece, else the origin (if still allowed)."""
        self._refresh()
        with self._lock:
            peers = self._holders(chunks)
            if peers:
                return min(peers, key=lambda p: self._busy.get(p.name, 0))
        return OriginSource(self.origin) if origin_ok else None

    def read_into(self, view: memoryview, off: int, length: int, write: bool = True, check: bool = True) -> None:
        """Fill ``view[:length]`` with data-region bytes ``off..off+length`` (whole chunks, or the
        region's end), checked; ``write``: write them to the cache's temporary file now, else they
        are written later from the device's copy (``Behind.put``). ``check=False`` (with
        ``write=False``): the device checks them as they land, and a bad piece comes back
        through ``refetch``."""
        chunks = self._chunks(off, length)
        at = self.packed.data_offset + off
        failures: list[str] = []
        origin_tries = 0
        while (src := self._pick(chunks, origin_ok=origin_tries < self.ORIGIN_TRIES)) is not None:
            from_origin = isinstance(src, OriginSource)
            with self._lock:
                self._busy[src.name] = self._busy.get(src.name, 0) + 1
                if from_origin:
                    self._reading.update(chunks)
            if from_origin:
                self._announce()
            t0 = time.perf_counter()
            t1 = None
            try:
                src.read_into(self.rel, at, view[:length])
                t1 = time.perf_counter()
                bad = self._check(view, off, length) if check else None
            except Exception as e:  # any failure of a source: the next one is tried
                bad = f"failed ({e})"
            finally:
                t2 = time.perf_counter()
                with self._lock:
                    self._busy[src.name] -= 1
                    self.stats.busy_s["read"] += (t1 or t2) - t0
                    self.stats.busy_s["check"] += t2 - (t1 or t2)
                    if from_origin:
                        self._reading.difference_update(chunks)
                        self._slowest_s = max(self._slowest_s, (t1 or t2) - t0)
                    if bad is None:
                        self.stats.bytes_from[src.name] = self.stats.bytes_from.get(src.name, 0) + length
                        self._sent[off] = src.name
                        if not write:
                            self._coming.update(chunks)
            if bad is None:
                if write:
                    self._land(view, off, length)
                return
            failures.append(f"{src.name}: {bad}")
            if from_origin:
                origin_tries += 1  # asked again once: a fault of one answer on the way
            else:
                self._drop(src, bad)
        raise RemoteError(f"{self.origin.uri}/{self.rel}: bytes {at}..{at + length} "
                          f"({self.packed.describe_chunk(chunks[0])}) could not be fetched from any source: "
                          + "; ".join(failures) + "; check the source (push the model again if its copy there "
                          "is corrupt)")

    def add_idle(self, seconds: dict[str, float]) -> None:
        """A device reader's seconds outside its reads, by cause (``stats.idle_s``'s keys)."""
        with self._lock:
            for k, v in seconds.items():
                self.stats.idle_s[k] += v

    def refetch(self, view: memoryview, off: int, length: int) -> None:
        """The device found the piece at ``off`` corrupt as it landed: the peer that sent it is
        dropped (the origin is asked again, as for a fault found on the host) and the piece read
        again into ``view``, checked here this time."""
        chunks = self._chunks(off, length)
        with self._lock:
            name = self._sent.pop(off, None)
            src = next((p for p in self._sources if p.name == name), None)
        what = f"a changed byte in {self.packed.describe_chunk(chunks[0])}"
        log.warning("%s: %s from %s, found on the device: fetched again", self.rel, what, name)
        if src is not None:
            self._drop(src, what)
        self.read_into(view, off, length, write=False)

    def _check(self, view: memoryview, off: int, length: int) -> str | None:
        from . import checksum
        # every piece is whole 4 KiB pages: the data region and its chunks are multiples of 4096
        data = np.frombuffer(view, dtype=np.uint8, count=length)
        first = off // self.cb
        got = checksum.chunk_sums_host(data, self.cb).tolist()
        for i, (a, b) in enumerate(got):
            want = self._sums[first + i]
            if (a & 0xFFFFFFFFFFFFFFFF, b & 0xFFFFFFFFFFFFFFFF) != tuple(want):
                return f"checksum mismatch in {self.packed.describe_chunk(first + i)}"
        return None

    def _land(self, view: memoryview, off: int, length: int) -> None:
        """Write checked bytes into the cache's temporary file; tell the peer service."""
        t0 = time.perf_counter()
        at = self.packed.data_offset + off
        done = 0
        while done < length:
            done += os.pwrite(self.fd, view[done:length], at + done)
        chunks = self._chunks(off, length)
        with self._lock:
            self._landed.update(chunks)
            self._coming.difference_update(chunks)
            self.stats.busy_s["write"] += time.perf_counter() - t0
        self._announce()

    def _announce(self) -> None:
        """Tell this node's peer service what the transfer holds and reads from the origin now."""
        if self.peers is None:
            return
        with self._lock:
            landed, reading = sorted(self._landed), sorted(self._reading | self._coming)
            seq = time.monotonic_ns()
        self.peers.announce(self.key, self.rel, str(self.tmp), landed, reading, seq)

    # ---------------------------------------------------------------- the whole file
    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        """The data region in pieces of whole chunks, from the piece where this node begins
        (``Peers.start_piece``; rotated: nodes that start together pass pieces to each other)."""
        step = self.piece_step(piece_bytes)
        n = self.packed.data_bytes
        out = [(o, min(step, n - o)) for o in range(0, n, step)]
        k = self.peers.start_piece(len(out)) % len(out) if out and self.peers is not None else 0
        return out[k:] + out[:k]

    def piece_step(self, piece_bytes: int) -> int:
        """The pieces' length (whole chunks; the last may be shorter)."""
        return max(self.cb, piece_bytes // self.cb * self.cb)

    def order(self, pieces: list[tuple[int, int]]) -> "PieceOrder":
        """``pieces`` as the reader threads take them (``PieceOrder.next``)."""
        return PieceOrder(self, pieces)

    def run(self, threads: int = 16, piece_bytes: int = 16 << 20) -> Path:
        """Fetch every piece with ``threads`` in parallel (no device: the CPU load maps the file
        afterwards), then ``commit``. Returns the entry's directory."""
        pieces = self.pieces(piece_bytes)
        step = max(length for _, length in pieces) if pieces else 0
        order = self.order(pieces)

        def reader() -> None:
            buf = memoryview(np.empty(-(-step // 4096) * 4096, dtype=np.uint8))
            try:
                for p in iter(order.next, None):
                    self.read_into(buf, *p)
            except BaseException:
                order.close()
                raise
        try:
            n = max(1, min(threads, len(pieces)))
            with ThreadPoolExecutor(n, "coldstart-fetch") as pool:
                for f in [pool.submit(reader) for _ in range(n)]:
                    f.result()
        except BaseException:
            self.abort()
            raise
        return self.commit()

    def write_behind(self, copier: Callable[[], Copier], threads: int = 2) -> "Behind":
        """Write the cache's file behind the device's copies (``Behind``); the transfer's reads
        are then made with ``write=False``."""
        self.behind = Behind(self, copier, threads)
        return self.behind

    def cached(self, timeout: float | None = None) -> Path:
        """Wait until the node cache holds the file (its writes may go on after the device has the
        bytes); returns the entry. Raises what kept it out: the cache is then left without it."""
        if self.behind is not None:
            self.behind.wait(timeout)
        elif not self._closed:
            raise RuntimeError(f"{self.final}: the transfer has not run")
        if not self.final.is_file():
            raise RemoteError(f"{self.final}: not in the node cache (the transfer was aborted)")
        return self.entry

    def commit(self) -> Path:
        """The transfer is whole and checked: the file takes its name; returns the entry."""
        with self._ending:
            if self._closed:
                raise RemoteError(f"{self.final}: the transfer was aborted before it was whole")
            if len(self._landed) != len(self._sums):
                self._end()
                raise RemoteError(f"{self.origin.uri}/{self.rel}: transfer ended with "
                                  f"{len(self._landed)} of {len(self._sums)} chunks")
            try:
                os.close(self.fd)
                publish_file(self.tmp, self.final)
            except BaseException:
                self._end()
                raise
            self._closed = True
            self.committed_at = time.perf_counter()
        self.cache.touch(self.entry)
        log.info("%s: %.2f GB in the node cache at %s (%s)", self.rel, self.packed.file_bytes / 1e9, self.final,
                 ", ".join(f"{k}: {v / 1e9:.2f} GB" for k, v in self.stats.bytes_from.items()))
        if self.peers is not None:
            self.peers.announce(self.key, self.rel, str(self.final), None, [], time.monotonic_ns())
        self._release()
        return self.entry

    def abort(self) -> None:
        """Remove the temporary file and let go of the entry (idempotent). Writes behind the
        device (``Behind``) are stopped first: none is under way when the file's descriptor
        closes (its number could be another file's a moment later)."""
        if self.behind is not None:
            self.behind.stop()
        with self._ending:
            if self._closed:
                return
            self._end()

    def _end(self) -> None:
        """``abort``'s work, the ending lock held."""
        self._closed = True
        try:
            os.close(self.fd)
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
        if self.peers is not None:
            try:
                self.peers.announce(self.key, self.rel, "", [], [], time.monotonic_ns())
            except Exception as e:
                log.info("peer service not told of the aborted transfer: %s", e)
        self._release()


class Copier(Protocol):
    """One writer thread's way to the device's copy of the data region (``weights.stream.Slots``)."""

    views: list[memoryview]

    def copy_back(self, s: int, off: int, length: int) -> None:
        """Fill ``views[s][:length]`` with data-region bytes ``off..off+length``; returns when done."""

    def close(self) -> None:
        """Free the staging memory."""


class Behind:
    """A transfer's writes into the node cache, behind the device's copies (see the module's
    docstring). ``put`` the pieces as they reach the device; ``threads`` writer threads copy each
    back (``Copier``), check its chunk sums again (the file gets only bytes the index vouches for,
    whatever happened to the device's copy) and write it; ``close`` once every piece was put: the
    file takes its name when the last is written, in the background. A failure of the writes
    aborts the file (the cache stays without it, logged) and never the load: the device's bytes
    were checked as they arrived. The threads are not daemons: an interpreter that exits first
    waits for the file."""

    def __init__(self, fetch: Fetch, copier: Callable[[], Copier], threads: int):
        self.fetch = fetch
        self._q: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._stopped = False
        self._queue_lock = threading.Lock()
        self._queue_ended = False  # the writers' end marks are queued
        self._done = threading.Event()
        self._writers = [threading.Thread(target=self._write, args=(copier,), name=f"coldstart-cache-{k}")
                         for k in range(threads)]
        for t in self._writers:
            t.start()
        self._closer = threading.Thread(target=self._finish, name="coldstart-cache")

    def put(self, off: int, length: int) -> None:
        """Data-region bytes ``off..off+length`` are on the device (checked): write them."""
        self._q.put((off, length))

    def _write(self, copier: Callable[[], Copier]) -> None:
        c = None
        try:
            c = copier()
            while (p := self._q.get()) is not None:
                if self._error is not None or self._stopped:
                    continue  # (drained to the end mark)
                off, length = p
                c.copy_back(0, off, length)
                bad = self.fetch._check(c.views[0], off, length)
                if bad is not None:
                    raise RemoteError(f"{self.fetch.final}: {bad} in the device's copy, not written to the node "
                                      "cache (the GPU's memory changed the bytes after they were checked)")
                self.fetch._land(c.views[0], off, length)
        except BaseException as e:
            self._error = self._error or e
            while self._q.get() is not None:  # the rest is not written; the end mark comes with close()
                pass
        finally:
            if c is not None:
                c.close()

    def close(self) -> None:
        """Every piece was put: the file takes its name once they are written (in the background)."""
        self._end_queue()
        self._closer.start()

    def _end_queue(self) -> None:
        with self._queue_lock:
            if not self._queue_ended:
                self._queue_ended = True
                for _ in self._writers:
                    self._q.put(None)

    def stop(self) -> None:
        """No more writes: the ones under way end, the rest are dropped; returns once the writers
        have ended (at once in one of the writers' own threads)."""
        self._stopped = True
        self._end_queue()
        me = threading.current_thread()
        if me is not self._closer and me not in self._writers:
            for t in self._writers:
                t.join()

    def cancel(self) -> None:
        """The transfer failed: stop writing, wait for the writes under way, remove the file."""
        self.fetch.abort()  # (stops the writers first)
        self._done.set()

    def _finish(self) -> None:
        try:
            for t in self._writers:
                t.join()
            if self._error is not None:
                raise self._error
            if self._stopped:
                raise RemoteError(f"{self.fetch.final}: the transfer was aborted")
            self.fetch.commit()
        except BaseException as e:
            self._error = self._error or e
            self.fetch.abort()
            log.warning("%s: not kept in the node cache (%s); the loaded model is unaffected, and the node's "
                        "next replica fetches it again", self.fetch.final, e)
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the file is committed; raise what kept it out of the cache."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.fetch.final}: still being written after {timeout} s")
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise RemoteError(f"{self.fetch.final}: the transfer failed; nothing kept in the node cache")


class PieceOrder:
    """One transfer's pieces as its reader threads take them: in the node's order, except that a
    piece a peer was reading from the origin at the last refresh (and no peer held yet) is put off
    to the end, and taken then once a peer holds it (it comes from that peer), once no peer reads
    it any more, or once it has waited ``Fetch.patience_s`` (it comes from the origin)."""

    def __init__(self, fetch: Fetch, pieces: list[tuple[int, int]]):
        self.fetch = fetch
        self.todo = deque(pieces)
        self.later: list[tuple[int, int, float]] = []  # put off: (offset, length, since)
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        """The transfer failed: ``next`` gives nothing more, a thread waiting in it returns."""
        self.closed = True

    def next(self) -> tuple[int, int] | None:
        """The next piece to read, as (data-region offset, length); None: none is left."""
        f = self.fetch
        while not self.closed:
            f._refresh()
            with self.lock:
                while self.todo:
                    off, length = self.todo.popleft()
                    if not f._wanted_elsewhere(f._chunks(off, length)):
                        return off, length
                    self.later.append((off, length, time.monotonic()))
                if not self.later:
                    return None
                now, patience = time.monotonic(), f.patience_s()
                for i, (off, length, since) in enumerate(self.later):
                    if now - since > patience or not f._wanted_elsewhere(f._chunks(off, length)):
                        del self.later[i]
                        return off, length
            time.sleep(f.REFRESH_S / 5)  # only pieces peers are reading are left: ask again soon
        return None


def _allocate(fd: int, size: int, path: Path) -> None:
    """Reserve the file's whole size now: a disk without room fails here, before any transfer."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (95, 22):  # EOPNOTSUPP, EINVAL: a filesystem without fallocate
            os.ftruncate(fd, size)
            return
        raise OSError(e.errno, f"{path.parent}: cannot hold the model's {size / 2**30:.2f} GiB in the node "
                      f"cache ({e.strerror}); free space there, or point COLDSTART_CACHE_DIR at a larger disk") from None


# ------------------------------------------------------------------------------------ resolve
def weight_rel(rank: int | None) -> str:
    return WEIGHTS_FILE if rank is None else f"{rank_dir(rank)}/{WEIGHTS_FILE}"


def read_header(origin: Origin, rel: str, local: Path) -> tuple[PackedFile, bytes, bytes]:
    """The remote file's header checked as ``read_packed`` checks a local one (``local``: where it
    will lie in the cache); also its raw preamble and index, written into the cache's copy."""
    size = origin.size(rel)
    got: dict[int, bytes] = {}

    def read(off: int, n: int) -> bytes:
        n = max(0, min(n, size - off))
        buf = bytearray(n)
        if n:
            origin.read_into(rel, off, memoryview(buf))
        got[off] = bytes(buf)
        return got[off]
    packed = parse_packed(local, size, read, where=f"{origin.uri}/{rel}")
    return packed, got[0], got[packed.data_offset + packed.data_bytes]


def _key_of(origin: Origin, rank: int | None, packed: PackedFile) -> tuple[str, bytes | None]:
    if rank is None:
        return packed.digest[:16], None
    import hashlib
    manifest = origin.get(TP_MANIFEST)
    return hashlib.sha256(manifest).hexdigest()[:16], manifest


def resolve(uri: str, cache: NodeCache, *, rank: int | None = None, peers: Peers | None = None,
            timeout_s: float = Timeouts.request_s) -> "Path | Fetch":
    """The local entry holding ``uri`` as it is at its source now, or the ``Fetch`` that brings it
    (see the module's docstring). ``rank``: one rank's file of a split pack (its side files and
    ``tp.json`` come with it). Where the source cannot be reached but the node holds an earlier
    copy, that copy is used with a warning naming the source and the error; where the source
    answers that the model is not there, the start fails (a removed model is not served).
    ``timeout_s``: one request to the source (a piece's ranged GET) may take this long before it
    counts as failed."""
    uri = check_uri(uri)
    name = model_name(uri)
    rel = weight_rel(rank)
    try:
        origin = Origin(uri, Timeouts(request_s=timeout_s))
        try:
            packed, head, tail = read_header(origin, rel, cache.root / rel)
        except RemoteNotFound:
            if rank is None and origin.exists(TP_MANIFEST):
                raise PackedFormatError(f"{uri}: a tensor-parallel pack ({TP_MANIFEST}); serve it with args.tp set "
                                        "to its number of ranks") from None
            raise
        key, manifest = _key_of(origin, rank, packed)
    except RemoteError as e:
        held = [p for p in cache.entries_of(uri, name) if (p / rel).is_file()]
        if not held:
            raise
        if isinstance(e, RemoteNotFound):  # an answer, not an outage: the model is gone from its source
            raise RemoteNotFound(f"{e}; this node holds an earlier copy ({held[0]}), which is not served: "
                                 "a model removed at its source is not served from a node's copy (push it "
                                 "again, or serve the copy's directory by its path)") from None
        log.warning("%s is unreachable (%s): serving the copy this node holds, %s, which may be older", uri, e,
                    held[0])
        cache.touch(held[0])
        return held[0]
    entry = cache.entry(uri, key, name)
    lock = cache.lock(entry)
    lock.__enter__()
    done = False
    try:
        cache.clean(entry)
        if (entry / rel).is_file():
            from .format import read_packed
            if read_packed(entry / rel).digest == packed.digest:
                cache.touch(entry)
                return entry
            os.unlink(entry / rel)  # (a copy whose index is not the source's: never served)
        if not entry.is_dir():
            _make_entry(origin, entry, packed, manifest)
        else:
            _check_sides(entry, packed, uri)
        cache.make_room(packed.file_bytes, keep=entry)
        (entry / rel).parent.mkdir(parents=True, exist_ok=True)
        packed.path = entry / rel
        fetch = Fetch(cache=cache, entry=entry, rel=rel, packed=packed, head=head, tail=tail, origin=origin,
                      peers=peers, key=key, release=lambda: lock.__exit__(None, None, None))
        done = True
        return fetch
    finally:
        if not done:
            lock.__exit__(None, None, None)


def _make_entry(origin: Origin, entry: Path, packed: PackedFile, manifest: bytes | None) -> None:
    """The entry's directory, whole: side files checked against the index, the kernel bundle (where
    the store lists one), tp.json for a split pack; written aside and renamed."""
    tmp = entry.with_name(partial_name(entry.name))
    tmp.mkdir(parents=True)
    try:
        listed = packed.index.side_files or {}
        # the small files' GETs at once: each waits for the store's first byte, which is most of its time
        with ThreadPoolExecutor(8, thread_name_prefix="coldstart-sides") as pool:
            listing = pool.submit(_kernel_files, origin)
            sides = {name: pool.submit(origin.get, name) for name in listed
                     if not (name == TP_MANIFEST and manifest is not None)}
            kernels = {rel: pool.submit(origin.get, rel) for rel in listing.result()}
            for name in sorted(listed):
                (tmp / name).write_bytes(manifest if name not in sides else sides[name].result())
            for rel, data in kernels.items():
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data.result())
        if packed.index.side_files is None:  # an older pack: copy what it has, unprotected
            for name in SIDE_FILES:
                if origin.exists(name):
                    (tmp / name).write_bytes(origin.get(name))
        _check_sides(tmp, packed, origin.uri)
        os.rename(tmp, entry)
    except BaseException:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _kernel_files(origin: Origin) -> list[str]:
    """The kernel bundle's files at the source (none where the store may not be listed)."""
    try:
        return origin.list("kernels/")
    except RemoteError as e:  # (a role that may read objects but not list them): the node compiles its own
        log.info("%s: no kernel bundle taken (%s)", origin.uri, e)
        return []


def _check_sides(d: Path, packed: PackedFile, uri: str) -> None:
    for name, want in (packed.index.side_files or {}).items():
        p = d / name
        if not p.is_file() or p.stat().st_size != want.bytes or file_sha256(p) != want.sha256:
            raise PackedFormatError(f"{uri}/{name}: not the file the weights' index lists (size or sha256 "
                                    "differ): the source holds a mix of two packs; push the model again whole")

