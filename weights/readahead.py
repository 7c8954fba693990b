"""Read-ahead hint for a packed model, issued before torch is even imported.

``prefetch(path)`` asks the kernel (``posix_fadvise(WILLNEED)``) to start
reading the weight file into the page cache, from a background thread, and
returns at once. A replica calls it first thing, so on a cold page cache the
disk already works while Python spends seconds importing torch and creating
the CUDA context. This module imports nothing heavy on purpose.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def prefetch(path: str | os.PathLike) -> threading.Thread | None:
    """Start read-ahead of ``model.cst`` (or a packed directory's one) in the background.

    Returns the thread (join it to wait for the hint to be issued), or None
    where the file is missing or the platform has no ``posix_fadvise``.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "model.cst"
    if not p.is_file() or not hasattr(os, "posix_fadvise"):
        return None

    def run() -> None:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError as e:
            log.warning("prefetch of %s skipped: %s", p, e)
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError as e:
            log.warning("prefetch of %s skipped: %s", p, e)
        finally:
            os.close(fd)

    t = threading.Thread(target=run, name="coldstart-prefetch", daemon=True)
    t.start()
    return t
