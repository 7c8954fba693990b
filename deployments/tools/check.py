"""What every `coldstart doctor` check returns, and the options it is run with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Same name as weights.format.WEIGHTS_FILE (a test keeps them equal); not imported
# so that the doctor works, and starts instantly, even where weights/ is broken.
WEIGHTS_FILE = "model.cst"
DEFAULT_MODEL_DIR = "weights/demo"
STATUSES = ("ok", "warn", "fail", "skip")
CONTEXT_WARN_S = 2.0
READ_WARN_GBPS = 1.0  # a 13.5 GB 7B model then takes > 13 s just to read
PINNED_WARN_GBPS = 10.0  # below PCIe 3.0 x16's ~12 GB/s: the pinned path is not working as it should
GIB = 1 << 30

@dataclass
class Check:
    """One line of the report."""

    check: str
    status: str  # one of STATUSES
    detail: str
    action: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Check.status: expected one of {STATUSES}, got {self.status!r}")


@dataclass
class DoctorOptions:
    """What `doctor` was asked to do (the command line, validated)."""

    model: Path = Path(DEFAULT_MODEL_DIR)
    model_given: bool = False  # a missing default dir is a skip, a missing given one a fail
    read_gib: float = 1.0
    threads: int = 8
    drop_cache: bool = False
    require_gpu: bool = False
    tp: int = 1  # the tensor-parallel ranks a replica on this node would have (>1: the tp rows)

    def __post_init__(self) -> None:
        if not self.read_gib > 0:
            raise ValueError(f"--read-gib: expected a number of GiB > 0, got {self.read_gib}")
        if not 1 <= self.threads <= 256:
            raise ValueError(f"--threads: expected 1..256, got {self.threads}")
        if not 1 <= self.tp <= 64:
            raise ValueError(f"--tp: expected the ranks of a tensor-parallel replica, 1..64, got {self.tp}")
