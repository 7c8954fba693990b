"""Where and when a benchmark ran: the fields every result file of bench/ carries (host, GPU,
commit, time), so that a figure can be told from another machine's or another tree's."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str:
    """The tree's commit, with "+changes" where tracked files differ from it; "unknown" without
    git. $BENCH_COMMIT, where set, instead: a copy of the tree sent to another machine, whose git
    state may not be the copy's."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return "unknown"
    return head + ("+changes" if _git("status", "--porcelain", "--untracked-files=no") else "")


def gpu() -> str:
    """The GPUs this process sees, as "N x NAME"; "none" where there is no CUDA device."""
    torch = sys.modules.get("torch")  # asked through torch only where the benchmark imported it already
    if torch is not None and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return "none"
        names = [n.strip() for n in out.stdout.splitlines() if n.strip()] if out.returncode == 0 else []
    if not names:
        return "none"
    return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)


def run_meta() -> dict:
    """host, gpu, commit and time (UTC, ISO 8601, to the second) of this run."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {"host": socket.gethostname(), "gpu": gpu(), "commit": commit(), "time": now.isoformat()}


def stamp(res: dict) -> dict:
    """``res`` with this run's host, gpu, commit and time added (fields it has already are kept)."""
    return {**run_meta(), **res}
