"""A replica's start: one ordered list of named, timed steps (``Start.steps``).

Each step is a phase of the replica's ``PhaseTimer`` (the ``[METRIC]`` log lines, ``/stats`` and
Ray's metrics). This module, with Ray's worker setup hook (``deployments.startup.early``), is the
only code that starts side threads, touches Python's garbage collector, or holds and releases
the bulk read of the weights; the engine, the model and the kernels know nothing of them.

On a GPU with a native model the engine is built while the weights' bytes arrive: the model,
the kernels' self-tests, the KV cache and the CUDA graphs need the weights' shapes and
addresses, never their values, so the start costs the longer of the two, not their sum.
Nothing reads a weight before the load has finished and every checksum matched (``load_wait``);
a corrupt file still fails the replica. When most of the weights are not in the page cache, a
helper reads them one piece at a time from the first step (the trickle), and the loader's bulk
read waits until the engine is built: the build's first kernel launches fault in pages of
CUDA's, torch's and Triton's libraries, and behind a bulk read of the same disk they would wait
for all of it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from deployments.config import DeploymentArgs
from deployments.startup import early
from weights.format import rank_dir
from weights.readahead import is_cold, stop_trickle, trickle
from weights.timing import PhaseTimer

if TYPE_CHECKING:  # annotations only: each step imports what it needs when it runs
    import torch

    from deployments.engine.decoder import Decoder
    from deployments.engine.engine import Engine
    from deployments.engine.mirror import Channel
    from deployments.engine.runner import ModelRunner
    from deployments.engine.tokenizer import Tokenizer
    from deployments.server.ranks import Ranks
    from deployments.startup.side import SideTask
    from deployments.peers import RayPeers
    from weights.fetch import Fetch
    from weights.loader import LoadedModel, PendingLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Started:
    """What a replica's start made, handed to the server as one object (``Start.started``)."""

    engine: Engine
    tokenizer: Tokenizer
    model: Decoder
    device: torch.device
    loaded: LoadedModel
    ranks: Ranks | None  # a tensor-parallel replica's other ranks
    finish: Callable[..., None]  # ``Start.finish``, after the first warm-up
    transfer: dict | None = None  # a remote model: where its bytes came from (``Start.resolve``)


@dataclass
class Step:
    name: str
    run: Callable[[], None]
    when: Callable[[], bool] = lambda: True


class Start:
    """One replica's start from ``args``; ``run()`` returns when the engine serves (not yet warm:
    ``reconfigure`` warms it). ``own_process``: the process is the replica's own (a Ray worker),
    so it may keep compiled modules per node and pause the garbage collector until ``finish``.

    A tensor-parallel replica (``args.tp`` = N > 1) is N processes: rank 0, the replica itself,
    whose first step starts the other ranks (``deployments.server.ranks``), and ranks 1..N-1,
    each running this same start with its ``rank`` and rank 0's ``rendezvous`` address up to its
    ``ModelRunner`` (``runner``); rank 0's engine then drives theirs (``deployments.engine.mirror``).
    Every rank loads only its own file of the split pack, and joins the model's process group
    (``tp_group``) before it builds its part of the model."""

    def __init__(self, args: DeploymentArgs, timer: PhaseTimer, *, own_process: bool = False, rank: int = 0,
                 rendezvous: str | None = None):
        self.args, self.timer, self.own_process = args, timer, own_process
        self.rank, self.tp, self.leader = rank, args.tp, rank == 0
        self.remote = args.is_remote()
        self.fetch: Fetch | None = None  # a remote model's transfer into this node's cache
        self.transfer: dict | None = None  # what /stats says of it (``resolve``)
        self._set_path(None if self.remote else args.model_path())
        self.rendezvous = rendezvous  # tcp://host:port of rank 0's process-group store (tp > 1)
        self.ranks: Ranks | None = None  # rank 0: the other ranks
        self.group: torch.distributed.ProcessGroup | None = None  # the model's process group (tp > 1)
        self.channel: Channel | None = None  # rank 0's calls to the other ranks
        self.runner: ModelRunner | None = None  # another rank's runner, which rank 0's engine drives
        self.opts = args.load
        self.device: torch.device | None = None
        self.pending: PendingLoad | None = None  # the load under way
        self.loaded: LoadedModel | None = None
        self.model: Decoder | None = None
        self.tokenizer: Tokenizer | None = None
        self.engine: Engine | None = None
        self.trickling = False
        self.overlap = False  # the engine is built while the weights arrive
        self.side: dict[str, SideTask] = {}  # the side threads' tasks

    def _set_path(self, path: Path | None) -> None:
        self.path = path  # the packed model's directory on this node (a remote one's cache entry)
        self.weights_dir = None if path is None else path if self.tp == 1 else path / rank_dir(self.rank)

    def steps(self) -> list[Step]:
        split = self.tp > 1
        lead = self.leader
        return [
            Step("ranks", self.launch_ranks, lambda: lead and split),  # the other ranks start beside this one
            Step("resolve", self.resolve, lambda: self.remote),  # a remote model: the node's copy, or its transfer
            Step("imports", self.imports),            # trickle, side threads, torch and the engine's modules
            Step("context", self.context),            # the device, its preflight checks and its CUDA context
            Step("tp_group", self.join_group, lambda: split),  # every rank joins the model's process group
            Step("load_start", self.start_load),      # one device buffer and its views; the reads begin (or wait)
            Step("load_first", self.wait_for_weights, lambda: not self.overlap),  # a model built after its load
            Step("engine_model", self.build_model),   # the decoder over the buffer's views, its kernels chosen
            Step("engine_tokenizer", self.read_tokenizer, lambda: lead),
            Step("engine_kv_cache", self.make_engine),  # rank 0: the engine; another rank: its runner
            Step("load_release", self.release_load, lambda: not lead and self.loaded is None),  # (another rank ends)
            Step("ranks_ready", self.ranks_ready, lambda: lead and split),  # theirs built; they follow rank 0
            Step("engine_graphs", self.start_engine, lambda: lead),  # first launches, graph capture, first prefills
            Step("load_wait", self.wait_for_weights, lambda: lead and self.loaded is None),  # what the build did not hide
            Step("ranks_loaded", self.ranks_loaded, lambda: lead and split),  # every rank's weights arrived and checked
        ]

    def run(self) -> "Start":
        if self.own_process:
            early.pause_gc()
        t0 = time.perf_counter()
        try:
            for step in self.steps():
                if not step.when():
                    continue
                with self.timer.phase(step.name):
                    step.run()
        except BaseException:
            self.abort()
            raise
        self.timer.record("engine", sum(p.seconds for p in self.timer.phases if p.name in
                                        ("engine_model", "engine_tokenizer", "engine_kv_cache", "engine_graphs")))
        self.timer.record("constructor", time.perf_counter() - t0)
        return self

    def started(self) -> Started:
        """Rank 0's start, once ``run`` returned: what the server serves with."""
        made = (self.engine, self.tokenizer, self.model, self.device, self.loaded)
        if not self.leader or any(x is None for x in made):
            raise RuntimeError("Start.started(): the start has not run to its end on rank 0")
        return Started(*made, self.ranks, self.finish, self.transfer)

    def finish(self, warm: bool) -> None:
        """After the first warm-up: what the start made lives as long as the process, so it is
        moved out of the garbage collector's generations (never walked again) and a paused
        collector turned back on; a warm-up that failed turns it back on without freezing."""
        if not self.own_process:
            return
        if early.gc_paused():
            early.resume_gc(freeze=warm)
        elif warm:
            gc.freeze()

    def abort(self) -> None:
        """A step failed: let the loader's threads end (a held load reads nothing), stop the
        trickle and the engine, turn the collector back on; the step's error is the one raised."""
        if self.pending is not None and self.loaded is None:
            self.pending.cancel()
            with contextlib.suppress(BaseException):
                self.pending.wait()
        if self.fetch is not None:
            self.fetch.abort()  # (a no-op once it completed)
        if self.weights_dir is not None:
            stop_trickle(self.weights_dir)
        if self.engine is not None:
            self.engine.shutdown()
        if self.ranks is not None:
            self.ranks.shutdown()
        early.resume_gc(freeze=False)

    # ---------------------------------------------------------------- steps
    def resolve(self) -> None:
        """A remote model: the entry of this node's cache that holds it, or (where none does) the
        transfer that brings it, from the other nodes and the source, as the load reads it."""
        from deployments.node_cache import model_cache
        from weights.fetch import Fetch, resolve
        cache = model_cache()
        peers = _peers(cache.root)
        got = resolve(self.args.model, cache, rank=self.rank if self.tp > 1 else None, peers=peers,
                      timeout_s=self.opts.remote_timeout_s)
        if isinstance(got, Fetch):
            self.fetch = got
            # bytes by source and the sources dropped, as the transfer goes on (the dicts themselves)
            self.transfer = {"model": self.args.model, "cache_entry": str(got.entry),
                             "bytes_from": got.stats.bytes_from, "dropped": got.stats.dropped,
                             "busy_s": got.stats.busy_s, "idle_s": got.stats.idle_s}
            log.info("%s: not on this node; fetching %.2f GB into %s", self.args.model,
                     got.packed.file_bytes / 1e9, got.entry)
            self._set_path(got.entry)
        else:
            self.transfer = {"model": self.args.model, "cache_entry": str(got), "node_copy": True}
            self._set_path(got)

    def imports(self) -> None:
        from deployments.device import gpu_expected
        from deployments.startup import context, triton_setup
        gpu = gpu_expected(self.args.device)
        self.trickling = gpu and self._start_trickle()
        if self.own_process:
            from deployments.startup import bytecode
            bytecode.enable()
        if triton_setup.wanted(self.args.device):  # before Triton's first use: its compiled kernels, if shipped
            from deployments.kernels import bundle
            with self.timer.phase("imports_kernels"):
                log.info("%s", bundle.install(self.path))
        self.side["context"] = context.start(self.args.device)
        self.side["triton"] = triton_setup.start(self.args.device)
        with self.timer.phase("imports_torch"):
            import torch  # noqa: F401  (what the minimal replica pays too)
        import deployments.engine.engine  # noqa: F401
        import deployments.engine.tokenizer  # noqa: F401
        import deployments.model  # noqa: F401
        import jinja2.sandbox  # noqa: F401  (the chat template is compiled as the tokenizer loads)
        import weights.loader  # noqa: F401

    def _start_trickle(self) -> bool:
        """Read weights that are mostly not in the page cache one piece at a time from now on
        (``load.trickle``; O_DIRECT reads would not use what it read)."""
        o = self.opts
        if not o.trickle or o.direct_io or o.cold_direct_io or not is_cold(self.weights_dir):
            return False
        started = trickle(self.weights_dir, o.trickle_read_bytes) is not None
        if started:
            log.info("%s: weights not in the page cache; reading them one piece at a time until the engine "
                     "is built", self.weights_dir)
        return started

    def context(self) -> None:
        from deployments.device import check_env, choose_device, create_context
        for w in check_env():
            log.warning(w)
        self.device = choose_device(self.args.device)
        ahead = self.side.pop("context", None)
        if ahead is not None and self.device.type == "cuda":
            ahead.wait()
            if ahead.result is not None:
                log.info("CUDA context not made ahead: %s", ahead.result)
            elif ahead.error is None and ahead.seconds is not None:
                self.timer.record("context_ahead", ahead.seconds)  # of the imports' time, on a side thread
        log.info("runtime: %s", create_context(self.device))

    def start_load(self) -> None:
        from deployments.model import is_native
        from weights import loader
        if self.ranks is None and self.fetch is None:  # (rank 0 of several checked it before it launched the others)
            check_pack(self.path, self.tp)
        self._t_load = time.perf_counter()
        self.pending = loader.start_load(self.fetch or self.path, self.device, rank=self.rank if self.tp > 1 else None,
                                         options=self.opts, timer=self.timer, hold=self.trickling,
                                         from_cache=self.remote)
        native = is_native(self.pending.config)
        # transformers' classes may copy the weights as they take them: only a native model is
        # built beside its load
        self.overlap = self.pending.background and native

    def wait_for_weights(self) -> None:
        """Release a held load and wait for its last byte and checksum; record the load's own
        duration and rate from its start (whatever ran beside it)."""
        self.loaded = self.pending.wait()  # (the loader stops the trickle as its reads begin)
        self.timer.record("load", self.pending.finished_at - self._t_load, self.loaded.nbytes)
        if self.pending.held_s:
            self.timer.record("load_held", self.pending.held_s)  # of it, the bulk read's wait for the build
        if self.model is not None:
            self.model.weights_loaded()

    def build_model(self) -> None:
        from deployments.model import build_model
        triton = self.side.pop("triton", None)
        if triton is not None:  # Triton's per-process set-up, before its first launch
            t = time.perf_counter()
            triton.wait()
            self.timer.record("engine_model_triton_wait", time.perf_counter() - t)
        self.model = build_model(self.pending.config, self.pending.tensors, tp=self.group)
        for step, seconds in self.model.build_s.items():  # the model's own build steps
            self.timer.record(f"engine_model_{step}", seconds)

    def read_tokenizer(self) -> None:
        from deployments.engine.tokenizer import Tokenizer
        self.tokenizer = Tokenizer.from_dir(self.path)

    def make_engine(self) -> None:
        if not self.leader:
            from deployments.engine.runner import ModelRunner
            self.runner = ModelRunner(self.model, self.args.engine.resolved(self.model.max_position_embeddings))
            return
        from deployments.engine.engine import Engine
        self.engine = Engine(self.model, self.tokenizer, self.args.engine, channel=self.channel)

    def start_engine(self) -> None:
        self.engine.start()

    # ---------------------------------------------------------------- a tensor-parallel replica's steps
    def launch_ranks(self) -> None:
        from deployments.server.ranks import Ranks
        if not self.remote:  # (a remote split pack: each rank's transfer checks its own file)
            check_pack(self.path, self.tp)  # before N-1 processes start for nothing
        self.ranks = Ranks.launch(self.args, type(self))

    def join_group(self) -> None:
        """Join the model's process group (NCCL on GPUs, gloo on the CPU) and rank 0's channel; on
        a GPU one all-reduce now, so the communicator exists before any graph capture."""
        import datetime

        import torch
        import torch.distributed as dist

        from deployments.engine.mirror import Channel
        from deployments.server.ranks import JOIN_TIMEOUT_S, GroupStore
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        ends = self.ranks.group_store if self.ranks is not None else GroupStore.at(self.rendezvous)
        dist.init_process_group("nccl" if cuda else "gloo", store=ends.store(self.tp), world_size=self.tp,
                                rank=self.rank, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        self.group = dist.group.WORLD
        self.channel = Channel.new()
        if cuda:
            with self.timer.phase("tp_group_first_all_reduce"):
                dist.all_reduce(torch.zeros(1, device=self.device))
                torch.cuda.synchronize(self.device)

    def release_load(self) -> None:
        """Another rank: its bulk read, held while it built, goes on while it follows rank 0's
        graph captures; rank 0 waits for it at ``ranks_loaded``."""
        self.pending.release()

    def ranks_ready(self) -> None:
        self.ranks.ready(self.timer)

    def ranks_loaded(self) -> None:
        """Every other rank waits for its weights (each file checked as it arrives); the first
        that failed fails the start, naming its rank."""
        self.channel.send(("load_wait", ()))
        self.ranks.loaded(self.channel.gather(None))


def _peers(root: Path) -> RayPeers | None:
    """This node's peer service and the other nodes' (``deployments.peers``), where the process is
    part of a Ray cluster; None elsewhere (the transfer then reads from the source alone)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    from deployments.peers import RayPeers
    return RayPeers(root)


def check_pack(path: Path, tp: int) -> None:
    """``path`` holds a packed model for ``tp`` ranks: one model.cst, or a split pack of exactly
    ``tp`` ranks; otherwise an error saying what is there and what to do."""
    from weights.format import read_manifest
    from weights.tp import is_split_pack
    if is_split_pack(path):
        size = read_manifest(path)["size"]
        if tp == 1:
            raise ValueError(f"{path} is split over {size} ranks (`coldstart pack --tp {size}`): set args.tp to "
                             f"{size} to serve it over {size} GPUs, or pack the source again without --tp")
        if size != tp:
            raise ValueError(f"args.tp is {tp}, but {path} is split over {size} ranks: set args.tp to {size}, or "
                             f"pack the model again with `coldstart pack SRC {path} --tp {tp} --force`")
        return
    if not (path / "model.cst").is_file():
        raise FileNotFoundError(
            f"{path}: no packed model here (model.cst missing); make one with `coldstart pack HF_DIR "
            f"{path}`, or run `coldstart serve` for the demo")
    if tp > 1:
        raise ValueError(f"args.tp is {tp}, but {path} is one unsplit model: pack it for {tp} ranks with "
                         f"`coldstart pack SRC DEST --tp {tp}`, or set args.tp to 1")
