"""A tensor-parallel model's ranks in lockstep: rank 0's runner calls, repeated on the others.

Every rank of a tensor-parallel model (``deployments.model.tp``) must make the same model calls
in the same order, because each call's collectives meet the other ranks' ones. The engine's
scheduler and sampling run once, on rank 0; its ``ModelRunner`` is wrapped in ``Mirrored``,
which sends each call that runs the model (its name and its plain-Python arguments: token ids,
slots, positions) to the other ranks over a ``Channel`` before running it. Each other rank runs
``follow``: the same calls on its own ``ModelRunner`` (its own KV cache, inputs and CUDA graphs),
whose logits it drops. State the calls change (which batch sizes have graphs, the cache) thus
changes the same way on every rank, and a late graph capture on rank 0 is one on every rank.

The channel is a gloo group of the same processes beside the model's own (NCCL on GPUs): its
messages are a few hundred bytes a step, and a rank waiting for rank 0's next call waits on a
socket, not on a GPU stream.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from deployments.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# the runner's calls that run the model or change its state; anything else (stats, attributes)
# is rank 0's own
CALLS = ("capture", "first_prefills", "prefill", "prefill_group", "decode", "zero_slot", "capture_late", "assign",
         "release")
# a rank waiting for rank 0's next call may wait as long as the replica is idle
IDLE = datetime.timedelta(days=365)


class Channel:
    """Rank 0's messages to the other ranks of ``group`` (a gloo group: ``Channel.new``)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0)

    @classmethod
    def new(cls, ranks: list[int] | None = None) -> "Channel":
        """A channel over the default group's processes (or ``ranks`` of them); every one of them
        must call this, in the same order as its other group creations."""
        return cls(dist.new_group(ranks, backend="gloo", timeout=IDLE))

    def send(self, message: Any) -> None:
        """Rank 0: ``message`` (picklable) to every other rank."""
        dist.broadcast_object_list([message], src=self._src, group=self.group)

    def receive(self) -> Any:
        """Another rank: rank 0's next message (waits for it)."""
        box = [None]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def gather(self, item: Any) -> list[Any]:
        """Every rank's ``item``, in rank order, on every rank."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, item, group=self.group)
        return out


class Mirrored:
    """``runner`` (a ``ModelRunner``) whose calls in ``CALLS`` are first sent over ``channel``;
    everything else is the runner's own."""

    def __init__(self, runner: ModelRunner, channel: Channel):
        self.runner, self.channel = runner, channel
        for name in CALLS:
            setattr(self, name, self._mirrored(name))

    def _mirrored(self, name: str) -> Callable[..., Any]:
        run = getattr(self.runner, name)

        def call(*args: Any) -> Any:
            self.channel.send((name, args))
            return run(*args)
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def stop(self) -> None:
        """Tell the other ranks to leave ``follow``."""
        self.channel.send(("stop", ()))


def follow(runner: ModelRunner, channel: Channel, handlers: dict[str, Callable[..., Any]] | None = None) -> None:
    """Another rank's loop: run rank 0's calls on ``runner`` until it sends stop. ``handlers``:
    more messages this rank answers (name -> function of the message's arguments).

    A call that fails the way it failed on rank 0 (a bad request: the same inputs fail the same
    way on every rank) is logged and the loop goes on, as rank 0's engine does; an error of the
    device stops the loop and is raised."""
    from deployments.engine.runner import is_device_error
    handlers = handlers or {}
    dev = runner.device
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    with torch.inference_mode():
        while True:
            name, args = channel.receive()
            if name == "stop":
                return
            run = handlers.get(name) or (getattr(runner, name) if name in CALLS else None)
            if run is None:
                raise RuntimeError(f"rank {channel.rank}: unknown call {name!r} from rank 0")
            try:
                run(*args)
            except Exception as e:
                if is_device_error(e) or name in handlers:
                    raise
                log.exception("rank %d: %s failed (as on rank 0)", channel.rank, name)
