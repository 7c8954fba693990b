"""A tensor-parallel replica's other ranks: Ray actors in the bundles of the replica's placement group.

Ray Serve places a replica with ``placement_group_bundles`` in bundle 0 of its own placement
group (``deployments.app.build_app`` asks for N bundles, ``STRICT_PACK``: one node). The replica
is rank 0; ``Ranks.launch`` starts ranks 1..N-1 as ``RankWorker`` actors in bundles 1..N-1 in the
replica's first step, so their processes start, import and load beside rank 0's. Each runs the
replica's own start (``deployments.server.start.Start``) as its rank, up to its runner, then
``follow``s rank 0's engine (``deployments.engine.mirror``) until the replica stops.

Rank 0 learns of the others through Ray: a rank whose start fails fails the replica's, naming
it; a rank whose loop ends (an error, a killed process) fails the replica's health check, so
Ray replaces the whole replica. Ranks are owned by the replica's process: when it exits, Ray
ends them too. Outside Ray Serve (tests, a Python program), the ranks are plain actors of the
running (or a new local) Ray instance.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import Any, Callable

from deployments.config import DeploymentArgs
from weights.timing import PhaseTimer

log = logging.getLogger("coldstart.server")

READY_TIMEOUT_S = 900  # a rank's whole start, its process's included (a 70B's share of a cold disk)
STOP_TIMEOUT_S = 5


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a process group's store; another process may still
    take it before the store binds it: a replica holds its port instead, ``GroupStore``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


JOIN_TIMEOUT_S = 300  # how long a rank waits for the others to join the model's group


class GroupStore:
    """The model's process-group store (torch's TCPStore) at ``tcp://host:port``.

    Rank 0 (``listen``) binds and holds its port from the replica's first step, before torch is
    imported, so no other process can take it between choosing the port and the store serving it;
    ``store(rank, world)`` then serves on that socket (rank 0) or connects to it (the others)."""

    def __init__(self, host: str, port: int, listener: socket.socket | None = None):
        self.host, self.port, self.listener = host, port, listener

    @classmethod
    def listen(cls, host: str) -> "GroupStore":
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, 0))
        sock.listen(128)
        return cls(host, sock.getsockname()[1], sock)

    @classmethod
    def at(cls, address: str) -> "GroupStore":
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        return cls(host.strip("[]"), int(port))

    @property
    def address(self) -> str:
        return f"tcp://[{self.host}]:{self.port}" if ":" in self.host else f"tcp://{self.host}:{self.port}"

    def store(self, world: int) -> Any:
        import datetime

        from torch.distributed import TCPStore
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        if self.listener is None:
            return TCPStore(self.host, self.port, world_size=world, is_master=False, timeout=timeout)
        try:
            store = TCPStore(self.host, self.port, world_size=world, is_master=True, wait_for_workers=False,
                             timeout=timeout, master_listen_fd=self.listener.fileno())
            self.listener.detach()  # the store's now: it closes the socket
            self.listener = None
            return store
        except (RuntimeError, TypeError, ValueError) as e:  # a torch whose store cannot take a socket
            log.info("the process-group store cannot serve on the held port (%s): binding it again", e)
            self.close()
            return TCPStore(self.host, self.port, world_size=world, is_master=True, wait_for_workers=False,
                            timeout=timeout)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def _where() -> str:
    """This process's node and GPUs, for messages about its rank."""
    import ray
    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    return f"{socket.gethostname()}, " + (f"GPU {','.join(map(str, gpus))}" if gpus else "no GPU")


class RankWorker:
    """Rank ``rank`` of a tensor-parallel replica (a Ray actor: ``Ranks.launch``): its ``start``
    (the replica's start class, ``deployments.server.start.Start``) run as that rank."""

    def __init__(self, start: type, args: dict, rank: int, rendezvous: str):
        self.rank, self.where = rank, _where()
        self.timer = PhaseTimer()
        t0 = time.perf_counter()
        try:
            self.start = start(DeploymentArgs.model_validate(args), self.timer, own_process=True, rank=rank,
                               rendezvous=rendezvous).run()
        except BaseException as e:
            raise RuntimeError(f"rank {rank} ({self.where}): {type(e).__name__}: {e}") from e
        self.timer.record("constructor", time.perf_counter() - t0)

    def ready(self) -> dict:
        return {"rank": self.rank, "where": self.where, "phases": self.timer.as_dict()}

    def follow(self) -> None:
        """Run rank 0's calls until it stops the replica (``deployments.engine.mirror.follow``)."""
        import torch.distributed as dist

        from deployments.engine.mirror import follow
        try:
            follow(self.start.runner, self.start.channel, {"load_wait": self._load_wait})
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def _load_wait(self) -> None:
        s, error = self.start, None
        try:
            if s.loaded is None:
                s.wait_for_weights()
        except Exception as e:  # noqa: BLE001 - every rank reports, then this one stops
            error = f"{type(e).__name__}: {e}"
        s.finish(warm=error is None)
        load = s.timer.get("load")
        s.channel.gather({"error": error, "load_s": load.seconds if load else None,
                          "load_GBps": load.gbps if load else None})
        if error is not None:
            raise RuntimeError(f"rank {self.rank} ({self.where}): {error}")


class Ranks:
    """Rank 0's view of ranks 1..N-1: launch, wait, health, stats, stop."""

    def __init__(self, actors: list[Any], store: GroupStore):
        self.actors, self.group_store = actors, store  # rank 0's end of the group's store
        self.info: list[dict] = [{"rank": k} for k in range(1, len(actors) + 1)]
        self.loops: list[Any] = []  # each rank's follow() call

    @classmethod
    def launch(cls, args: DeploymentArgs, start: type) -> "Ranks":
        """Start ranks 1..N-1 (N = ``args.tp``) in the replica's placement group's bundles 1..N-1,
        each running ``start`` (the replica's start class) as its rank."""
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deployments.device import gpu_expected
        if not ray.is_initialized():
            log.info("a tensor-parallel replica runs its ranks as Ray actors: starting a local Ray")
            ray.init()
        store = GroupStore.listen(ray.util.get_node_ip_address())
        pg = get_current_placement_group()
        n = args.tp
        if pg is not None and len(pg.bundle_specs) < n:
            raise ValueError(f"args.tp is {n}, but the replica's placement group has {len(pg.bundle_specs)} "
                             f"bundles: set the deployment's placement_group_bundles to {n} bundles (one GPU each)")
        worker = ray.remote(RankWorker)
        actors = []
        for k in range(1, n):
            if pg is not None:
                spec = pg.bundle_specs[k]
                opts = {"num_cpus": spec.get("CPU", 0), "num_gpus": spec.get("GPU", 0),
                        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k)}
            else:
                opts = {"num_cpus": 1, "num_gpus": 1 if gpu_expected(args.device) else 0}
            actors.append(worker.options(**opts).remote(start, args.model_dump(), k, store.address))
        log.info("tensor-parallel replica: %d ranks, rank 0 here, group at %s", n, store.address)
        return cls(actors, store)

    def ready(self, timer: PhaseTimer) -> None:
        """Wait for every rank's start (up to its runner), then set their loops going; a rank whose
        start failed fails this one, named."""
        import ray
        t = time.perf_counter()
        pending = {a.ready.remote(): k for k, a in enumerate(self.actors, 1)}
        while pending:
            done, _ = ray.wait(list(pending), timeout=max(1.0, READY_TIMEOUT_S - (time.perf_counter() - t)))
            if not done:
                raise TimeoutError(f"ranks {sorted(pending.values())} did not start within {READY_TIMEOUT_S} s")
            for ref in done:
                k = pending.pop(ref)
                try:
                    self.info[k - 1] = ray.get(ref)
                except Exception as e:
                    raise RuntimeError(f"tensor-parallel rank {k} of {len(self.actors) + 1} failed to start: "
                                       f"{_cause(e)}") from e
        timer.record("ranks_ready_wait", time.perf_counter() - t)
        self.loops = [a.follow.remote() for a in self.actors]

    def loaded(self, reports: list[dict]) -> None:
        """Rank 0's part of the ranks' load barrier: ``reports``, every rank's (rank 0's is None)."""
        bad = []
        for k, r in enumerate(reports[1:], 1):
            self.info[k - 1]["phases"]["load"] = r["load_s"]
            self.info[k - 1]["load_GBps"] = r["load_GBps"]
            if r["error"]:
                bad.append(f"rank {k} ({self.info[k - 1].get('where', '?')}): {r['error']}")
        if bad:
            raise RuntimeError("tensor-parallel ranks failed to load: " + "; ".join(bad))

    def check(self) -> None:
        """Raise, naming the rank, when a rank's loop has ended (its error, or its process gone)."""
        import ray
        if not self.loops:
            return
        done, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        for ref in done:
            k = self.loops.index(ref) + 1
            where = self.info[k - 1].get("where", "?")
            try:
                ray.get(ref)
            except Exception as e:
                raise RuntimeError(f"tensor-parallel rank {k} ({where}) stopped: {_cause(e)}") from e
            raise RuntimeError(f"tensor-parallel rank {k} ({where}) left its loop")

    def describe(self) -> list[dict]:
        return list(self.info)

    def shutdown(self, stop: Callable[[], None] | None = None) -> None:
        """Stop every rank: ``stop()`` (rank 0's mirrored runner's) ends their loops where rank 0's
        engine has stopped; then their processes end."""
        import ray
        import torch.distributed as dist
        if stop is not None and self.loops:
            with contextlib.suppress(Exception):
                stop()
                ray.wait(self.loops, num_returns=len(self.loops), timeout=STOP_TIMEOUT_S)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors, self.loops = [], []
        self.group_store.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _cause(e: BaseException) -> str:
    """The innermost message of a Ray error (a rank's own error says its rank and GPU)."""
    cause = getattr(e, "cause", None) or e.__cause__
    return str(cause) if cause is not None else str(e)
