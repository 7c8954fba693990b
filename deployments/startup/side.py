"""A start-up step's work on a side thread, and what became of it."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


class SideTask:
    """``fn()`` on a daemon thread from now on. ``wait`` joins it; ``seconds`` is how long it ran,
    ``result`` what it returned, ``error`` what it raised (logged, never re-raised: a side task
    only ever saves time, and the main thread does the same work itself where it failed)."""

    def __init__(self, name: str, fn: Callable[[], Any]):
        self.name = name
        self.seconds: float | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            self.result = fn()
        except Exception as e:  # noqa: BLE001 - see the class docstring
            self.error = e
            log.warning("%s failed (%r): the replica does that work itself", self.name, e)
        self.seconds = time.perf_counter() - t0

    def wait(self, timeout: float = 60.0) -> "SideTask":
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s still runs after %.0f s; going on without it", self.name, timeout)
        return self

    def done(self) -> bool:
        return not self._thread.is_alive()
