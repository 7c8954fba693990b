"""One small phase timer for every start-up phase: feeds the log and the metrics.

Each phase becomes a ``[METRIC]`` log line (``phase=load seconds=0.412
GBps=32.71 bytes=...``) and is passed to every sink, which is how the Ray Serve
deployment turns phases into ``ray.serve.metrics`` gauges. A phase that times
GPU work must end when the device is done (the loader's phases end on their
copies' events), not when a launch returned.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

log = logging.getLogger("coldstart.metrics")

Sink = Callable[[str, float, "int | None"], None]


@dataclass
class Phase:
    name: str
    seconds: float
    nbytes: int | None = None

    @property
    def gbps(self) -> float | None:
        if not self.nbytes or self.seconds <= 0:
            return None
        return self.nbytes / self.seconds / 1e9

    def line(self) -> str:
        s = f"[METRIC] phase={self.name} seconds={self.seconds:.4f}"
        if self.gbps is not None:
            s += f" GBps={self.gbps:.2f} bytes={self.nbytes}"
        return s


class PhaseTimer:
    """Times named phases; ``phases`` keeps them in order of completion."""

    def __init__(self, sinks: list[Sink] | None = None):
        self.phases: list[Phase] = []
        self.sinks: list[Sink] = list(sinks or [])

    @contextmanager
    def phase(self, name: str, nbytes: int | None = None) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - t0, nbytes)

    def record(self, name: str, seconds: float, nbytes: int | None = None) -> Phase:
        p = Phase(name, seconds, nbytes)
        self.phases.append(p)
        log.info(p.line())
        for sink in self.sinks:
            sink(name, seconds, nbytes)
        return p

    def get(self, name: str) -> Phase | None:
        for p in reversed(self.phases):
            if p.name == name:
                return p
        return None

    def as_dict(self) -> dict[str, float]:
        return {p.name: round(p.seconds, 6) for p in self.phases}
