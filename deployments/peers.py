"""Nodes pass a model's bytes to each other through Ray, with no service for the user to start.

Each node that starts a replica of a remote model gets one ``NodeService``: a Ray actor pinned to
that node (named ``coldstart-node-<node id>``, detached so it outlives the replica, no CPU of its
own). It answers, for an entry of the node cache (``weights.cache``), which chunks of a weight file
the node holds (the whole file once its transfer completed, else the chunks already checked) and
which it is reading from the model's origin now, and reads the held bytes for another node. The
bytes travel as Ray objects, through Ray's own object transfer between nodes, inside the
cluster's authenticated channels: no new port is opened.

``RayPeers`` is what a replica's transfer (``weights.fetch.Fetch``) sees of this: the other nodes'
services that hold some of the file (``sources``), and its own node's service, told of every
checked piece (``announce``). A peer that fails or sends a corrupt byte is dropped by the transfer
and its pieces fetched from another peer or the source.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NAMESPACE = "coldstart"
PREFIX = "coldstart-node-"
ASK_S = 5.0  # a peer that does not say what it holds within this is left out
READ_S = 60.0  # one piece from a peer


class NodeService:
    """One node's cache, as its peers see it (a Ray actor; see the module's docstring)."""

    def __init__(self, root: str):
        self.root = Path(root)
        # (entry key, file) -> (path, chunks held (None: all), chunks being read from the origin,
        # the process of the transfer reading them)
        self.files: dict[tuple[str, str], tuple[str, "set[int] | None", list[int], int]] = {}
        self.seq: dict[tuple[str, str], int] = {}  # the latest announcement's time, per file

    def announce(self, key: str, rel: str, path: str, chunks: "list[int] | None", reading: list[int],
                 seq: int, pid: int = 0) -> None:
        # calls run on several threads of this actor, so they may arrive out of order: an older
        # word (a piece's, read before the transfer completed) never overwrites a newer one
        if seq <= self.seq.get((key, rel), -1):
            return
        self.seq[(key, rel)] = seq
        if not path:
            self.files.pop((key, rel), None)
        else:
            self.files[(key, rel)] = (path, None if chunks is None else set(chunks), list(reading), pid)

    def _find(self, key: str, rel: str) -> "tuple[str, set[int] | None, list[int], int] | None":
        got = self.files.get((key, rel))
        if got is not None:
            return got
        if self.root.is_dir():  # complete copies made before this service started (or by another)
            for model in self.root.iterdir():
                p = model / key / rel
                if p.is_file():
                    return str(p), None, [], 0
        return None

    def holds(self, key: str, rel: str) -> "tuple[list[int] | None, list[int]] | bool":
        """False: nothing of it; else (the chunks held, None: the whole file; the chunks being read
        from the origin, none where the transfer's process has gone: they will never come)."""
        got = self._find(key, rel)
        if got is None:
            return False
        return None if got[1] is None else sorted(got[1]), got[2] if _alive(got[3]) else []

    def read(self, key: str, rel: str, offset: int, length: int) -> Any:
        import numpy as np
        got = self._find(key, rel)
        if got is None:
            raise FileNotFoundError(f"{rel} of entry {key}: not held on this node")
        out = np.empty(length, dtype=np.uint8)
        try:
            fd = os.open(got[0], os.O_RDONLY)
        except FileNotFoundError:  # a transfer that completed between the announcement and now
            self.files.pop((key, rel), None)
            got = self._find(key, rel)
            if got is None:
                raise
            fd = os.open(got[0], os.O_RDONLY)
        try:
            done = 0
            while done < length:
                n = os.preadv(fd, [memoryview(out)[done:]], offset + done)
                if n == 0:
                    raise EOFError(f"{got[0]}: ends before byte {offset + length}")
                done += n
        finally:
            os.close(fd)
        return out

    def ping(self) -> str:
        return str(self.root)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this node still runs (0: not known, taken as running)."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it runs
        pass
    return True


class PeerSource:
    """Another node's service as a source of a transfer (``weights.fetch.Source``)."""

    def __init__(self, name: str, handle: Any, key: str, held: "list[int] | None", reading: list[int]):
        self.name, self.handle, self.key = name, handle, key
        self._held = None if held is None else set(held)
        self._reading = set(reading)

    def holds(self, rel: str) -> "set[int] | None":
        return self._held

    def reading(self, rel: str) -> set[int]:
        return self._reading

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        import ray

        from weights.remote import copy_into
        arr = ray.get(self.handle.read.remote(self.key, rel, offset, len(view)), timeout=READ_S)
        if arr.nbytes != len(view):
            raise EOFError(f"asked for {len(view)} bytes at {offset}, got {arr.nbytes}")
        copy_into(view, memoryview(arr))
        del arr  # the object store's copy can go


class RayPeers:
    """The cluster's node services, as a replica's transfer asks them (``weights.fetch.Peers``)."""

    def __init__(self, root: str | os.PathLike):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        self.node = ray.get_runtime_context().get_node_id()
        actor = ray.remote(NodeService).options(
            name=PREFIX + self.node, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
            max_concurrency=64, scheduling_strategy=NodeAffinitySchedulingStrategy(self.node, soft=False))
        self.own = actor.remote(str(root))
        self._handles: dict[str, Any] = {}

    def start_piece(self, n_pieces: int) -> int:
        """Where this node's transfer begins: the cluster's live nodes, in the order of their ids,
        begin evenly spaced along the file, so nodes starting together each read a different
        stretch from the source first and take the rest from each other."""
        import ray
        if not n_pieces:
            return 0
        try:
            ids = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
            i = ids.index(self.node)
        except Exception as e:  # the cluster's table is a help, never a reason to fail
            log.info("live nodes not listed (%s): this node begins at the file's start", e)
            return 0
        return i * n_pieces // len(ids)

    def _others(self) -> dict[str, Any]:
        import ray
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX)
                 and a["name"] != PREFIX + self.node]
        for n in names:
            if n not in self._handles:
                try:
                    self._handles[n] = ray.get_actor(n, namespace=NAMESPACE)
                except ValueError:  # gone since it was listed
                    continue
        return {n: self._handles[n] for n in names if n in self._handles}

    def sources(self, key: str, rel: str) -> list[PeerSource]:
        import ray
        others = self._others()
        if not others:
            return []
        refs = {n: h.holds.remote(key, rel) for n, h in others.items()}
        out = []
        for n, ref in refs.items():
            try:
                held = ray.get(ref, timeout=ASK_S)
            except Exception as e:  # a node going away: not a source this time
                log.info("peer %s did not answer (%s)", n, type(e).__name__)
                continue
            if held is not False:
                out.append(PeerSource(n[len(PREFIX):][:12], others[n], key, *held))
        return out

    def announce(self, key: str, rel: str, path: str, chunks: "list[int] | None", reading: list[int],
                 seq: int) -> None:
        self.own.announce.remote(key, rel, path, chunks, reading, seq, os.getpid())
