"""What allocating a replica's two big device buffers costs with the allocator's expandable
segments (the deployment's PYTORCH_CUDA_ALLOC_CONF) and as one plain segment
(``weights.loader.one_segment``), each in a fresh process after its CUDA context; and what
importing the Triton module its first launcher imports costs in a fresh process (GPU machine).

    PYTHONPATH=$PWD python bench/kv_alloc.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from weights.segments import one_segment
mode = sys.argv[2]
dev = torch.device("cuda", 0)
torch.empty(1, device=dev); torch.cuda.synchronize()
out = {"mode": mode}
for name, make in (("weights_13.5GB", lambda: torch.empty(13_476_831_232, dtype=torch.uint8, device=dev)),
                   ("kv_32GiB", lambda: torch.zeros((2, 32, 16, 32, 4096, 128), dtype=torch.float16, device=dev))):
    t = time.perf_counter()
    if mode == "one_segment":
        with one_segment(dev):
            x = make()
    else:
        x = make()
    torch.cuda.synchronize()
    out[name + "_s"] = round(time.perf_counter() - t, 4)
    globals()[name] = x
small = torch.empty(1 << 20, device=dev)  # after: the setting is back for everything else
segs = torch.cuda.memory_snapshot()
out["segments"] = [{"MiB": round(s["total_size"] / 2**20), "expandable": s.get("is_expandable")} for s in segs]
print(json.dumps(out))
"""

GLUON = r"""
import json, time
import torch, triton
t = time.perf_counter()
try:
    import triton.experimental.gluon.nvidia.hopper
    print(json.dumps({"triton": triton.__version__, "import_gluon_hopper_s": round(time.perf_counter() - t, 4)}))
except ImportError as e:
    print(json.dumps({"triton": triton.__version__, "import_gluon_hopper": f"absent: {e}"}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_MODULE_LOADING": "LAZY"}
    runs = []
    for mode in ("expandable", "one_segment", "expandable", "one_segment"):
        r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), mode], env=env, capture_output=True,
                           text=True, timeout=300)
        if r.returncode:
            raise SystemExit(f"{mode}: {r.stderr[-2000:]}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "segments"}), flush=True)
    g = subprocess.run([sys.executable, "-c", GLUON], capture_output=True, text=True, timeout=300)
    gluon = json.loads(g.stdout.strip().splitlines()[-1]) if g.returncode == 0 else {"error": g.stderr[-500:]}
    print(json.dumps(gluon))
    res = {"command": "PYTHONPATH=$PWD python bench/kv_alloc.py " + " ".join(sys.argv[1:]), "runs": runs, "gluon": gluon}
    if a.out:
        a.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
