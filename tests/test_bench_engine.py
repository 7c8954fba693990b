"""bench/engine.py on the CPU, as the GPU runs call it: a failing benchmark would otherwise be
found only on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, "bench/engine.py", "--random", "tiny", "--device", "cpu", "--dtype", "float32",
                        "--no-hf", "--max-seq-len", "256", "--new-tokens", "8", "--out", str(out), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_mixed_load_over_the_paged_cache_with_the_step_profile(tmp_path):
    res = _bench(tmp_path, "--kv-cache", "paged", "--max-slots", "8", "--concurrency", "1,8",
                 "--prompt-lens", "8,100", "--profile", "--prefill-chunk", "64")
    assert res["prompt_lens"] == [8, 100] and res["kv_cache"] == "paged" and res["preemptions"] == 0
    assert all(res[k] for k in ("host", "gpu", "commit", "time"))  # where and when it ran (bench/meta.py)
    assert res["tokens_per_s_b8"] > 0 and res["tokens_per_s_b1"] > 0
    # each load's bound beside it, from the two ceilings measured at the start (bench/bound.py)
    assert res["ceilings"]["copy_bytes_per_s"] > 0 and res["ceilings"]["flops_per_s"] > 0
    for c in (1, 8):
        b = res[f"bound_b{c}"]
        assert b["seconds"] == b["prefill_s"] + b["decode_s"] and b["engine_share"] > 0
    assert res["bound_decode_ms_per_token_b1"] > 0 and res["engine_share_decode_b1"] > 0
    # every concurrent prompt's tokens were prefilled: 8 prompts of 8..100 tokens, and the profile's 8 more
    assert res["engine_stats"]["finished"] >= 8 + 8
    prof = res["profile"]
    # 8 new tokens each: the first from the prefill, the other 7 from at least 7 decode steps
    assert prof["concurrency"] == 8 and prof["decode_steps"] >= 7 and prof["decode_device_ms_per_step"] is None
    lines = prof["cprofile_tottime"]  # the loop thread's profile: its header, then its busiest functions
    assert "function calls" in lines[0] and sum("{built-in method" in x or ".py:" in x for x in lines) >= 10


def test_bad_prompt_lengths_are_refused(tmp_path):
    r = subprocess.run([sys.executable, "bench/engine.py", "--random", "tiny", "--prompt-lens", "50,10"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--prompt-lens (50, 10): want LO,HI with 1 <= LO <= HI" in r.stderr


def test_bench_quant_runs_each_format_beside_fp16_on_the_cpu(tmp_path):
    """bench/quant.py end to end on the tiny shape (its GPU run uses bench/load.py's probes instead
    of the in-process CPU load)."""
    out = tmp_path / "quant.json"
    r = subprocess.run([sys.executable, "bench/quant.py", "--work", str(tmp_path / "work"), "--shape", "tiny",
                        "--formats", "fp8,gptq", "--quantize-fp8", "--device", "cpu", "--repeats", "1",
                        "--concurrency", "1,4", "--new-tokens", "4", "--max-seq-len", "256", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [row["format"] for row in res["rows"]] == ["fp16", "fp8", "gptq", "fp16-quantize-fp8"]
    for row in res["rows"]:
        assert row["decode_ms_per_token_b1"] > 0 and row["tokens_per_s_b4"] > 0 and row["load_s"] > 0
    assert res["rows"][1]["kernels"] == "dequantize + matmul" and "decode_speedup_vs_fp16" in res["rows"][1]
    assert res["commit"] and res["time"]


def test_bench_quant_refuses_an_unknown_format(tmp_path):
    r = subprocess.run([sys.executable, "bench/quant.py", "--formats", "int3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--formats: int3 unknown" in r.stderr


def test_bench_quant_sizes_a_whole_shape_from_two_of_its_layers(tmp_path):
    """--sizes-only's extrapolation, on a shape small enough to pack whole: the same bytes, to the
    few of the side files that do not grow with the layers (the layer count written in them)."""
    from weights import PackOptions, make_demo, pack
    out = tmp_path / "sizes.json"
    r = subprocess.run([sys.executable, "bench/quant.py", "--work", str(tmp_path / "work"), "--shape", "small",
                        "--formats", "gptq", "--device", "cpu", "--sizes-only", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    sizes = json.loads(out.read_text())["whole_sizes"]
    for fmt in ("fp16", "gptq"):
        make_demo(tmp_path / fmt, "small", quant=None if fmt == "fp16" else fmt)
        pack(tmp_path / fmt, tmp_path / f"{fmt}-packed", PackOptions(progress=False))
        whole = sum(f.stat().st_size for f in (tmp_path / f"{fmt}-packed").iterdir() if f.is_file())
        assert abs(sizes[fmt]["whole_bytes"] - whole) < 64 and 0 < sizes[fmt]["per_layer_bytes"] < whole
    assert sizes["gptq"]["whole_bytes"] < sizes["fp16"]["whole_bytes"] / 2
