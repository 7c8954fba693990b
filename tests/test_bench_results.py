"""The benchmark suite's results: bench/RESULTS.md is what bench/results/ gives, the docs cite only
results that exist, and a stage of bench/gpu.sh writes its one file with host, GPU, commit and time."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import results  # noqa: E402

# a path under bench/results, and before it, where the doc cites git's history, a commit: `REV:bench/results/...`
CITED = re.compile(r"(?:\b([0-9a-f]{7,40}):)?(bench/results/[A-Za-z0-9_./*-]*[A-Za-z0-9_*/-])")


def test_results_md_is_what_the_files_give():
    assert results.RESULTS_MD.read_text() == results.render(), \
        "bench/RESULTS.md is stale against bench/results/: run `python bench/results.py`"


def _doc_citations() -> list[tuple[str, str | None, str]]:
    docs = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(d.name, m[0] or None, m[1].rstrip(".")) for d in docs for m in CITED.findall(d.read_text())]


def _not_in_history(cited: list[tuple[str, str | None, str]]) -> list[tuple[str, str]]:
    """The REV:PATH citations git does not hold; checked where the history is here: not in a copy
    without .git, nor for a commit a shallow clone cut off (a full clone that lacks it fails)."""
    if not (ROOT / ".git").exists():
        return []

    def git(*args: str) -> int:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).returncode

    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip() == "true"
    return [(doc, f"{rev}:{p}") for doc, rev, p in sorted({c for c in cited if c[1] is not None})
            if not (shallow and git("cat-file", "-e", f"{rev}^{{commit}}"))
            and git("cat-file", "-e", f"{rev}:{p.rstrip('/')}")]


def test_the_docs_cite_only_results_that_exist():
    cited = _doc_citations()
    assert any(p == "bench/results/engine.json" for _, _, p in cited)  # the pattern finds what the README quotes
    in_tree = [(doc, p) for doc, rev, p in cited if rev is None]
    missing = [(doc, p) for doc, p in in_tree if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"docs cite results that are not in the tree (cite git's history as REV:PATH): {missing}"
    gone = _not_in_history(cited)
    assert not gone, f"docs cite history that git does not hold: {gone}"
    assert _not_in_history([("x.md", "402fe9e", "bench/results/nothing.json")]) == [
        ("x.md", "402fe9e:bench/results/nothing.json")]
    # RESULTS.md's own links (results/STAGE.json, relative to bench/)
    for link in re.findall(r"\]\((results/[^)]+)\)", results.RESULTS_MD.read_text()):
        assert (ROOT / "bench" / link).is_file(), link


def test_the_readme_and_measurements_quote_results_md():
    """Every bold figure of the README's "Measured" and measurements.md's "Current figures" is in RESULTS.md."""
    md = results.RESULTS_MD.read_text()
    readme = (ROOT / "README.md").read_text()
    meas = (ROOT / "docs" / "measurements.md").read_text()
    quoted = readme[readme.index("## Measured"):] + meas[meas.index("## Current figures"):meas.index("### Earlier")]
    figures = re.findall(r"\*\*([^*]+)\*\*", quoted)
    assert len(figures) >= 20
    assert not [f for f in figures if f not in md], "quoted figures that bench/RESULTS.md does not have"


def test_gpu_sh_runs_the_stages_results_py_knows():
    text = (ROOT / "bench" / "gpu.sh").read_text()
    assert tuple(re.search(r'^STAGES="([^"]+)"', text, re.M).group(1).split()) == results.STAGES
    for stage in results.STAGES:
        assert f"stage_{stage.replace('-', '_')}()" in text, stage
    assert len(results.STAGES) <= 10


def test_every_results_file_is_a_stage_with_where_and_when():
    found = results.read_results()
    assert {"engine", "serve", "load"} <= set(found)
    for stage, d in found.items():
        assert all(d[k] for k in results.META), stage
        assert d["parts"], stage


def test_a_stray_file_in_the_results_is_refused(tmp_path):
    (tmp_path / "engine-paged-128.json").write_text("{}")
    with pytest.raises(ValueError, match="engine-paged-128.json: not a stage's results file"):
        results.render(tmp_path)
    (tmp_path / "engine-paged-128.json").unlink()
    (tmp_path / "engine.json").write_text(json.dumps({"stage": "engine", "parts": {}}))
    with pytest.raises(ValueError, match=r"engine.json: not written by `bench/results.py stage` \(missing \['command'"):
        results.render(tmp_path)


def test_pytest_counts():
    log = "....\n=== 109 passed, 1 skipped, 911 deselected, 1 warning in 142.33s (0:02:22) ===\n"
    assert results.pytest_counts(log) == {"passed": 109, "skipped": 1, "deselected": 911,
                                          "summary": "109 passed, 1 skipped, 911 deselected, 1 warning in 142.33s (0:02:22)"}
    with pytest.raises(ValueError, match="no pytest summary line"):
        results.pytest_counts("ImportError: no module named torch\n")


@pytest.fixture
def suite(tmp_path) -> Path:
    """bench/gpu.sh with results.py and meta.py in a git tree of their own (no GPU stage runs here)."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    for f in ("gpu.sh", "results.py", "meta.py"):
        shutil.copy(ROOT / "bench" / f, tree / "bench" / f)
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"]):
        subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True)
    return tree


def _gpu_sh(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    import os
    return subprocess.run(["bash", "bench/gpu.sh", *args], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": "", **env})


def test_a_script_stage_is_skipped_with_a_line_where_its_script_is_absent(suite, tmp_path):
    r = _gpu_sh(suite, str(tmp_path / "out"), "fetch", "quant")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fetch: skipped: bench/fetch.py is not in this tree" in r.stdout
    assert "quant: skipped: bench/quant.py is not in this tree" in r.stdout
    assert not list((tmp_path / "out").iterdir())
    r = _gpu_sh(suite, str(tmp_path / "out"), "fetch", "ckpt")
    assert r.returncode == 2 and "unknown stage ckpt (stages: tests load engine" in r.stdout


def test_a_stage_writes_its_one_file_and_a_failed_one_keeps_it(suite, tmp_path):
    # a stand-in for the script another change brings: what the stage passes it, and its JSON
    (suite / "bench" / "quant.py").write_text(
        "import json, sys\n"
        "a = sys.argv[1:]\n"
        "if '--fail' in a: sys.exit('failed on purpose')\n"
        "open(a[a.index('--out') + 1], 'w').write(json.dumps({'summary': {'GBps': 1.5}, 'args': a}))\n")
    out = suite / "bench" / "results"
    r = _gpu_sh(suite, str(out), "quant", QUANT_ARGS="--from s3://b/m")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads((out / "quant.json").read_text())
    assert d["stage"] == "quant" and d["command"] == "QUANT_ARGS=--from\\ s3://b/m bash bench/gpu.sh OUT quant"
    assert re.fullmatch(r"[0-9a-f]{12}(\+changes)?", d["commit"]) and d["host"] and d["gpu"] and d["time"]
    assert d["parts"]["quant"]["summary"] == {"GBps": 1.5}
    assert d["parts"]["quant"]["args"][-2:] == ["--from", "s3://b/m"]
    # the results dir is the tree's: RESULTS.md made again, with the new figure
    md = (suite / "bench" / "RESULTS.md").read_text()
    assert "| `GBps` | 1.500 |" in md and "File: [bench/results/quant.json](results/quant.json)" in md
    r = _gpu_sh(suite, str(out), "quant", QUANT_ARGS="--fail")
    assert r.returncode != 0 and "=== quant failed" in r.stdout and "left as it was" in r.stdout
    assert json.loads((out / "quant.json").read_text()) == d


def test_the_figures_of_a_stage_run_with_its_variants():
    """A variant leaves out some of a stage's runs or fields: RESULTS.md shows what there is."""
    found = results.read_results()
    run = {k: v for k, v in found["engine"]["parts"]["run-1"].items()
           if not re.fullmatch(r"tokens_per_s_b(1|64)|decode_ms_per_token_b1", k)}
    run.update(prompt_lens=[32, 3000], new_tokens=64)  # ENGINE_ARGS="--prompt-lens 32,3000 --new-tokens 64"
    assert results.FIGURES["engine"]({"run-1": run}) == [
        ("128 requests at once (32-3000 in, 64 out), paged cache", "**8,561 tokens/s** (0.73 of the GPU's bound)")]
    serve = {k: v for k, v in found["serve"]["parts"]["report"].items() if "_cold" not in k}  # SERVE_CACHES=warm
    rows = dict(results.FIGURES["serve"]({"report": serve}))
    assert not [k for k in rows if "cold page" in k] and rows[
        "replica start in Ray Serve (added -> RUNNING, median), warm page cache"].startswith("**6.65 s**; minimal 9.24 s")
    report = json.loads(json.dumps(found["fresh-node"]["parts"]["report"]))
    del report["detail"]["fresh_runs_s"]  # FRESH_REPEAT=1
    assert "**coldstart 16.42 s**" in results.FIGURES["fresh-node"]({"report": report})[0][1]
    assert results.FIGURES["load"]({"load-warm": {"warm_GBps": 30.0, "warm_runs_GBps": [29.0, 30.0, 31.5]}}) == [
        ("warm loads (`--warm-only`)", "median 30.0 GB/s of 29.0, 30.0, 31.5")]


ENGINE_STAND_IN = """import json, sys
a = sys.argv[1:]
out = a[a.index('--out') + 1]
res = {'model': a[0], 'args': a, 'tokens_per_s_b128': 100.0 if 'llama3-8b' in a[0] else 200.0,
       'tokens_per_s_b64': 50.0, 'decode_ms_per_token_b1': 5.0}
open(out, 'w').write(json.dumps(res))
print('tokens_per_s_b128', res['tokens_per_s_b128'])
"""
LOAD_STAND_IN = """from pathlib import Path
def ensure_checkpoint(work, shape):
    (work / 'hf').mkdir(parents=True, exist_ok=True)
    (work / 'hf' / 'config.json').write_text(shape)
    (work / 'packed').mkdir(parents=True, exist_ok=True)
    (work / 'packed' / 'model.cst').write_text(shape)
    return work / 'hf', work / 'packed', {}
"""


@pytest.mark.parametrize("with_8b", [True, False])
def test_the_engine_stage_runs_the_7b_the_packed_8b_and_the_prefix_runs(suite, tmp_path, with_8b):
    (suite / "bench" / "engine.py").write_text(ENGINE_STAND_IN)
    (suite / "bench" / "load.py").write_text(LOAD_STAND_IN)
    out, work = tmp_path / "out", tmp_path / "work"
    r = _gpu_sh(suite, str(out), "engine", BENCH_WORK=str(work), **({} if with_8b else {"ENGINE_8B": "0"}))
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads((out / "engine.json").read_text())
    assert set(d["parts"]) == {"run-1", "prefix", "prefix-off"} | ({"llama3-8b-1"} if with_8b else set())
    assert d["parts"]["run-1"]["model"] == str(work / "packed")
    assert d["parts"]["prefix"]["args"][-4:-2] == ["--concurrency", "64"]
    if with_8b:
        assert d["parts"]["llama3-8b-1"]["model"] == str(work / "llama3-8b" / "packed")
        assert (work / "llama3-8b" / "packed" / "model.cst").read_text() == "llama3-8b"
        assert not (work / "llama3-8b" / "hf").exists()  # (the disk: only the pack is kept)
        assert "llama3-8b tokens_per_s_b128 100.0" in r.stdout
        rows = dict(results.FIGURES["engine"](d["parts"]))
        assert rows["the Llama-3-8B shape, 128 requests at once; batch-1 decode"] == "**100 tokens/s**; 5.00 ms/token"
    else:
        assert not (work / "llama3-8b").exists() and "ENGINE_8B=0" in d["command"]


FETCH_STAND_IN = """import json, sys
a = sys.argv[1:]
open(a[a.index('--out') + 1], 'w').write(json.dumps({'args': a}))
"""
STEPS_STAND_IN = """import json, sys
a = sys.argv[1:]
doc = {'args': a, 'threads': 16, 'writes': {'pwrite_one_file': {'GBps': 5.0}, 'pwrite_file_per_thread': {'GBps': 40.0},
       'mapped_populated_one_file': {'error': 'no MADV_POPULATE_WRITE'}},
       'pipeline': {'reads': {'GBps': 24.0}, 'copy': {'GBps': 15.0}, 'sums': {'GBps': 13.0}, 'gpu': {'GBps': 12.0},
                    'pwrite': {'GBps': 5.5}}}
open(a[a.index('--out') + 1], 'w').write(json.dumps(doc))
"""


def test_the_fetch_stage_times_the_transfer_steps_on_the_model_fetch_served(suite, tmp_path):
    (suite / "bench" / "fetch.py").write_text(FETCH_STAND_IN)
    (suite / "bench" / "transfer_steps.py").write_text(STEPS_STAND_IN)
    out = tmp_path / "out"
    r = _gpu_sh(suite, str(out), "fetch", FETCH_ARGS="--packed /m/packed --parts source")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads((out / "fetch.json").read_text())
    assert d["parts"]["fetch"]["args"][-4:] == ["--packed", "/m/packed", "--parts", "source"]
    assert d["parts"]["steps"]["args"][:2] == ["--packed", "/m/packed"]
    rows = dict(results.FIGURES["fetch"](d["parts"]))
    assert rows["that transfer's steps apart (16 threads): the reads alone, then + copy, + sums, + gpu, + pwrite "
                "(into the one cache file)"] == "24.00 GB/s; 15.00 GB/s; 13.00 GB/s; 12.00 GB/s; 5.50 GB/s"
    assert rows["writes alone: into one file; one file per thread; one file mapped"] == (
        "5.00 GB/s; 40.00 GB/s; no MADV_POPULATE_WRITE")
    (suite / "bench" / "transfer_steps.py").unlink()  # a tree without it: the fetch part alone
    r = _gpu_sh(suite, str(out), "fetch")
    assert r.returncode == 0 and set(json.loads((out / "fetch.json").read_text())["parts"]) == {"fetch"}


def test_a_transfer_written_behind_the_gpu_shows_both_moments():
    """A source round with the cache's writes behind the GPU's copies: the load and the whole
    cache file are two rows, each with its share of the plain reads; an older round, one row."""
    def rnd(pipe: float, cached: float | None) -> dict:
        r = {"raw_obstore": {"GBps": 20.0}, "pipeline": {"GBps": pipe}, "ratio": pipe / 20}
        if cached is not None:
            r["pipeline"]["cached_GBps"], r["cached_ratio"] = cached, cached / 20
        return r
    src = {"node_copy": {"GBps": 9.0}, "local_packed": {"GBps": 10.0}}
    rows = dict(results.FIGURES["fetch"]({"fetch": {"source": {**src, "rounds": [rnd(12.0, 5.0), rnd(14.0, 6.0)]}}}))
    assert rows["the same model loaded into the GPU, every piece checked"] == (
        "**12.00, 14.00 GB/s** (0.60, 0.70 of the plain reads)")
    assert rows["... and the node cache's copy whole (written behind the GPU's copies)"] == (
        "5.00, 6.00 GB/s (0.25, 0.30 of the plain reads)")
    old = dict(results.FIGURES["fetch"]({"fetch": {"source": {**src, "rounds": [rnd(4.0, None)]}}}))
    assert old["the same model loaded into the GPU and the node cache, every piece checked"] == (
        "**4.00 GB/s** (0.20 of the plain reads)")


def test_the_replicas_own_part_of_each_start_is_shown_beside_rays():
    def case(total: float, ray: float, fetch: float | None = None) -> dict:
        detail = {"total": total, **({"fetch": fetch} if fetch is not None else {})}
        return {"start_to_running_s": total + ray, "detail": detail}
    rounds = [{"local": case(2.0, 9.0), "remote_empty_cache": case(3.5, 6.0, 2.5), "remote_node_copy": case(1.9, 6.0)},
              {"local": case(2.5, 7.0), "remote_empty_cache": case(4.0, 7.0, 3.0), "remote_node_copy": case(2.1, 7.0)}]
    rows = dict(results.FIGURES["fetch"]({"run": {"serve": {"rounds": rounds}}}))
    assert rows["the same, the model at the source and an empty node cache"] == "**9.50, 11.00 s**"
    assert rows["the replica's own part of those starts (its constructor to warm): the model on the node; at the "
                "source (of it, the transfer); in the node cache"] == (
        "2.00, 2.50 s; 3.50, 4.00 s (2.50, 3.00 s); 1.90, 2.10 s")


def test_the_quant_kernel_sweep_is_shown_per_scheme_and_row_count():
    def entry(N, K, rows, paths):
        return {"scheme": "awq", "N": N, "K": K, "rows": rows, "cublas_fp16_ms": 0.016,
                "paths": [{"path": p, "ms": ms} if ms else {"path": p, "error": "CompilationError"}
                          for p, ms in paths]}
    sweep = {"quant": {"a": entry(4096, 4096, 1, [("tile-m16", 0.0155), ("gemv-(64, 128, 4, 4)", 0.0145),
                                                    ("gemv-(64, 64, 4, 4)", 0.0131)]),
                       "b": entry(11008, 4096, 1, [("tile-m16", 0.0332), ("gemv-(64, 128, 4, 4)", None)])}}
    rows = dict(results._quant({"kernel-sweep": sweep}))
    # the GEMV at its default blocks (the first of its rows), a failed path named as such
    assert rows == {"awq, 1 row: us per layer (4096x4096 / 11008x4096)":
                    "cuBLAS on the fp16 weight 16.0 / 16.0; tile-m16 15.5 / 33.2; GEMV 14.5 / failed"}
