"""The benchmark suite's results: one file per stage of bench/gpu.sh, and bench/RESULTS.md made from them.

    python bench/results.py            # write bench/RESULTS.md from bench/results/*.json
    python bench/results.py --check    # exit 1 where bench/RESULTS.md is not what the files give

bench/gpu.sh calls the other two commands: `stage` writes a stage's one results file (its command,
host, GPU, commit and time, and its runs' JSON files as "parts"), `pytest-counts` turns the GPU
tests' log into a part.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.meta import run_meta  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
# the stages of bench/gpu.sh, in its order (tests/test_bench_results.py holds the two to one list)
STAGES = ("tests", "load", "engine", "kernels", "serve", "fresh-node", "http", "tp", "fetch", "quant")
META = ("command", "host", "gpu", "commit", "time")


def assemble(stage: str, command: str, parts: dict[str, Path]) -> dict:
    """A stage's results file: this run's host, GPU, commit and time, and each part's JSON."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: not a stage of bench/gpu.sh ({', '.join(STAGES)})")
    read = {}
    for name, path in parts.items():
        try:
            read[name] = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"stage {stage}, part {name}: {path} was not written (see the stage's log "
                                    "beside it)") from None
        except ValueError as e:
            raise ValueError(f"stage {stage}, part {name}: {path} is not JSON ({e})") from None
    return {"stage": stage, "command": command, **run_meta(), "parts": read}


def pytest_counts(log: str) -> dict:
    """pytest's last summary line as counts: {"passed": 109, "skipped": 1, ..., "summary": line}."""
    lines = [x for x in log.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", x)]
    if not lines:
        raise ValueError("no pytest summary line (`N passed ...`) in the log: did pytest run?")
    line = lines[-1].strip("= ")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed)", line)}
    return {**counts, "summary": line}


# ---- the figures RESULTS.md shows for each stage ----

def _num(v: float, digits: int = 2) -> str:
    return f"{v:,.0f}" if digits == 0 else f"{v:,.{digits}f}"


def _each(vals: list[float], digits: int = 2, unit: str = "") -> str:
    return ", ".join(_num(v, digits) for v in vals) + (f" {unit}" if unit else "")


def _runs(parts: dict, prefix: str) -> list[dict]:
    """The parts named PREFIX-1, PREFIX-2, ..., in order."""
    keys = sorted((k for k in parts if re.fullmatch(rf"{prefix}-\d+", k)), key=lambda k: int(k.rsplit("-", 1)[1]))
    return [parts[k] for k in keys]


def _tests(p: dict) -> list[tuple[str, str]]:
    t = p["pytest"]
    return [("GPU tests (`-m gpu`)", t["summary"])]


def _load(p: dict) -> list[tuple[str, str]]:
    rows = []
    if "load" in p:
        s = p["load"]
        rows += [("the packed 7B onto the GPU, warm page cache", f"**{_num(s['warm_GBps'], 1)} GB/s** "
                  f"({_num(s['warm_s'])} s)"),
                 ("the same, cold page cache", f"**{_num(100 * s['cold_vs_disk'], 1)} %** of the disk's read "
                  f"({_num(s['disk_GBps'])} GB/s)"),
                 ("safetensors `load_file`, HF `from_pretrained`, warm",
                  f"{_num(s['safetensors_warm_GBps'], 1)}, {_num(s['hf_warm_GBps'], 1)} GB/s"
                  if "hf_warm_GBps" in s else f"{_num(s['safetensors_warm_GBps'], 1)} GB/s")]
    if "load-warm" in p:
        s = p["load-warm"]
        rows.append(("warm loads (`--warm-only`)", f"median {_num(s['warm_GBps'], 1)} GB/s of "
                     f"{_each(s['warm_runs_GBps'], 1)}"))
    if "load-cold-sweep" in p:
        rows.append(("cold settings swept (`--cold-sweep-only`)", f"{len(p['load-cold-sweep']['cold_sweep'])} runs: "
                     "see the file"))
    return rows


def _load_of(run: dict) -> str:
    """What each request of an engine run was: its prompt and its new tokens (128 and 128 by default)."""
    lens = run.get("prompt_lens")
    prompt = f"{lens[0]}-{lens[1]} in" if lens else f"{run.get('prompt_len', 128)} in"
    shared = f" behind a shared {run['shared_prefix']}-token prefix" if run.get("shared_prefix") else ""
    return f"{prompt}, {run.get('new_tokens', 128)} out{shared}"


def _tokens_per_s(run: dict) -> dict[int, float]:
    """A bench/engine.py run's ``tokens_per_s_bN`` fields, by N (requests at once)."""
    return {int(k[len("tokens_per_s_b"):]): v for k, v in run.items() if re.fullmatch(r"tokens_per_s_b\d+", k)}


def _engine(p: dict) -> list[tuple[str, str]]:
    runs, base = _runs(p, "run"), _runs(p, "baseline")
    rows = []
    if runs:
        conc = sorted(_tokens_per_s(runs[0]))
        for c in sorted(conc, reverse=True):
            if c == 1:
                continue
            v = _each([r[f"tokens_per_s_b{c}"] for r in runs], 0, "tokens/s")
            v = f"**{v}**" if c == max(conc) else v
            if all(f"bound_b{c}" in r for r in runs):  # bench/engine.py's bound of the load, and its share
                v += f" ({_each([r[f'bound_b{c}']['engine_share'] for r in runs], 2)} of the GPU's bound)"
            rows.append((f"{c} requests at once ({_load_of(runs[0])}), {runs[0].get('kv_cache', '')} cache", v))
            if base and f"tokens_per_s_b{c}" in base[0]:
                rows.append(("the same, the baseline tree (BASELINE) in the same runs",
                             _each([r[f"tokens_per_s_b{c}"] for r in base], 0, "tokens/s")))
        if "decode_ms_per_token_b1" in runs[0]:
            v = _each([r["decode_ms_per_token_b1"] for r in runs], 2, "ms/token")
            if all("engine_share_decode_b1" in r for r in runs):
                v += f" ({_each([r['engine_share_decode_b1'] for r in runs], 2)} of the GPU's bound)"
            rows.append(("batch-1 decode", v))
    for r in _runs(p, "llama3-8b"):  # the grouped-query subject (8 kv heads, a 128k vocabulary)
        tps = _tokens_per_s(r)
        c = max(tps)
        rows.append((f"the Llama-3-8B shape, {c} requests at once; batch-1 decode",
                     f"**{_num(tps[c], 0)} tokens/s**; {_num(r['decode_ms_per_token_b1'])} ms/token"))
    if "prefix" in p:
        off = f"; without prefix reuse {_num(p['prefix-off']['tokens_per_s_b64'], 0)}" if "prefix-off" in p else ""
        rows.append(("64 chats behind one 1,024-token system prompt",
                     f"**{_num(p['prefix']['tokens_per_s_b64'], 0)} tokens/s**{off}"))
    return rows


def _kernels(p: dict) -> list[tuple[str, str]]:
    rows, s = [], p.get("sweep", {})
    if "wide" in s:
        w = s["wide"]
        rows.append((f"a {w['rows']}-row decode step's device time", f"the projections {_num(w['gemm_ms_per_step'])} ms, "
                     f"the paged attention {_num(w['attention_default_ms'])} ms for {_num(w['attention_read_gb'])} GB"))
    swept = [k for k in ("gemv", "attention", "paged_attention") if k in s]
    if swept:
        rows.append(("sweeps in the file", ", ".join(swept)))
    for name in sorted((k for k in p if k.startswith("prefill-")), key=lambda k: int(k.split("-")[1])):
        f = p[name]
        rows.append((f"a shared prefill of {f['rows']} x {f['prompt_len']} tokens, one forward",
                     f"**{_num(f['device_ms'], 1)} ms** on the device (wall {_num(f['wall_ms'], 1)}), the projections "
                     f"{_num(f['gemm_ms'], 1)} ms ({_num(f['gemm_tflops'], 0)} TFLOP/s)"))
    return rows


def _serve(p: dict) -> list[tuple[str, str]]:
    s, rows = p["report"], []
    for cache in ("warm", "cold"):
        # the kinds' medians (serve.json's KIND_warm_s, KIND_cold_s; its differences hold an underscore)
        kinds = {k[: -len(f"_{cache}_s")]: v for k, v in s.items() if k.endswith(f"_{cache}_s")
                 and "_" not in k[: -len(f"_{cache}_s")] and isinstance(v, (int, float))}
        if "coldstart" not in kinds:
            continue
        floors = "; ".join(f"{k} {_num(kinds.pop(k))} s" for k in ("minimal", "transformers") if k in kinds)
        rows.append((f"replica start in Ray Serve (added -> RUNNING, median), {cache} page cache",
                     f"**{_num(kinds.pop('coldstart'))} s**; {floors}"))
        if kinds:
            rows.append((f"the other kinds, {cache} page cache", "; ".join(f"{k} {_num(v)} s" for k, v in kinds.items())))
    if "cold_goal_s" in s:
        rows.append(("the cold goal: minimal + the disk's time for the weights", f"{_num(s['cold_goal_s'])} s"))
    if "scale_up_decision_to_first_answer_s" in s:
        rows.append(("scale-up 1 -> 2 replicas under load: Ray's decision -> the new replica's first answer",
                     f"**{_num(s['scale_up_decision_to_first_answer_s'], 1)} s**"))
    if "answers_agree" in s:
        rows.append(("every start gave the same greedy tokens", f"{'yes' if s['answers_agree'] else 'NO'} "
                     f"({s['answers']} starts)"))
    if "start-profile" in p:
        rows.append(("the replica's start under cProfile", f"{_num(p['start-profile']['wall_s'])} s: see the file"))
    return rows


def _fresh_node(p: dict) -> list[tuple[str, str]]:
    s = p["report"]
    # each kind's starts, round by round (one round: serve.json keeps its start alone)
    rounds = s["detail"].get("fresh_runs_s") or {k: [v["start_to_running_s"]] for k, v in s["detail"]["fresh"].items()
                                                 if v.get("start_to_running_s") is not None}
    rows = [("a new node's first replica, round by round (added -> RUNNING)",
             "; ".join(f"{'**' if k == 'coldstart' else ''}{k} {_each(v)} s{'**' if k == 'coldstart' else ''}"
                       for k, v in rounds.items()))]
    if {"fresh_node_goal_s", "disk_read_s", "disk_GBps"} <= set(s):
        rows.append(("the goal: minimal + the disk's time for the weights + 1 s (medians)",
                     f"{_num(s['fresh_node_goal_s'])} s (the disk: {_num(s['disk_read_s'])} s, "
                     f"{_num(s['disk_GBps'])} GB/s)"))
    return rows


def _http(p: dict) -> list[tuple[str, str]]:
    rows, eng = [], p.get("engine", {})
    alone = _tokens_per_s(eng)
    for name in [k for k in p if k in ("baseline", "http") or k.startswith("http-")]:
        h = p[name]
        for c, runs in h["runs"].items():
            tps = [r["tokens_per_s"] for r in runs]
            med = statistics.median(tps)
            share = f", {_num(100 * med / alone[int(c)], 0)} % of the engine alone" if int(c) in alone else ""
            env = " ".join(f"{k}={v}" for k, v in h.get("env", {}).items())
            label = {"http": "through Ray Serve's HTTP front", "baseline": "the same, the baseline tree"}.get(
                name, f"the same with {env or 'defaults'}")
            outside = statistics.median(r["outside_engine_s_median"] for r in runs
                                        if r.get("outside_engine_s_median") is not None) if runs else None
            rows.append((f"{label}, {c} requests at once ({h.get('clients', 1)} client processes), bursts",
                         f"{'**' if name == 'http' else ''}{_each(tps, 0, 'tokens/s')}{'**' if name == 'http' else ''}"
                         f" (median {_num(med, 0)}{share}); a request's time outside the engine "
                         f"{_num(outside)} s (median)" if outside is not None else _each(tps, 0, "tokens/s")))
    for c, v in sorted(alone.items(), reverse=True):
        rows.insert(0, (f"the engine alone, {c} requests at once", f"{_num(v, 0)} tokens/s"))
    return rows


def _tp(p: dict) -> list[tuple[str, str]]:
    rows = []
    if "rank-load" in p:
        s = p["rank-load"]["summary"]
        rows.append((f"one rank of a 70B-shaped TP=4 pack ({_num(s['rank_file_GB'])} GB) onto one GPU",
                     f"warm **{_each(s['warm_runs_GBps'], 1, 'GB/s')}**; cold "
                     f"**{_each([100 * x for x in s['cold_vs_disk_pairs']], 1, '%')}** of the disk's read"))
    if "channel" in p:
        s = p["channel"]["summary"]
        for tp in (2, 4):
            us = [v for k, v in s.items() if k.startswith(f"tp{tp}_")]
            if us:
                rows.append((f"the TP={tp} lockstep per decode call (batch 1 to 256)",
                             f"{_num(min(us) / 1000)}-{_num(max(us) / 1000)} ms"))
    if "engine-rank" in p:
        e = p["engine-rank"]
        rows.append(("one rank's decode step of a 70B at TP=4, the all-reduce left out",
                     f"batch 1 **{_num(e['decode_ms_per_token_b1'])} ms/token**; 16 at once "
                     f"{_num(e['tokens_per_s_b16'], 0)} tokens/s"))
    for name in (k for k in p if k.startswith("serve-")):
        rows += _scalars(p[name].get("summary", p[name]), name)
    return rows


def _step(v: dict) -> str:
    """A timed step's rate, or why it did not run."""
    return f"{_num(v['GBps'])} GB/s" if "GBps" in v else v.get("error", "not run")


def raw_best(r: dict) -> float:
    """A source round's plain-read figure (``bench/fetch.py``): the faster of its clients' (GB/s)."""
    return max(r[k]["GBps"] for k in ("raw_obstore", "raw_direct") if k in r)


def _fetch(p: dict) -> list[tuple[str, str]]:
    """bench/fetch.py's parts (each a run of some of its parts: source, peer, serve)."""
    rows = []
    several = sum("source" in f for f in p.values()) > 1
    for name, f in p.items():
        src = f.get("source")
        if src:
            tag = f"{name}: " if several else ""  # (runs of two trees side by side: each named)
            raw = [raw_best(r) for r in src["rounds"]]
            pipe = [r["pipeline"]["GBps"] for r in src["rounds"]]
            both = all("raw_direct" in r for r in src["rounds"])
            rows.append((f"{tag}a remote 7B from a local S3-speaking source: plain ranged reads, 16 at once ("
                         + ("the faster of obstore's and the standard library's into a buffer" if both else "obstore")
                         + ")", _each(raw, 2, "GB/s")))
            # (the cache's writes behind the device's copies: two moments; before, one)
            cached = [r for r in src["rounds"] if "cached_ratio" in r]
            rows.append((f"{tag}the same model loaded into the GPU{'' if cached else ' and the node cache'}, every "
                         "piece checked", f"**{_each(pipe, 2, 'GB/s')}** ({_each([r['ratio'] for r in src['rounds']], 2)}"
                         " of the plain reads)"))
            if cached:
                rows.append((f"{tag}... and the node cache's copy whole (written behind the GPU's copies)",
                             f"{_each([r['pipeline']['cached_GBps'] for r in cached], 2, 'GB/s')} "
                             f"({_each([r['cached_ratio'] for r in cached], 2)} of the plain reads)"))
            rows.append((f"{tag}the next load, from the node's copy; the packed directory",
                         f"{_num(src['node_copy']['GBps'])} GB/s; {_num(src['local_packed']['GBps'])} GB/s"))
        if "pipeline" in f and "writes" in f:  # bench/transfer_steps.py: each step of a piece apart
            steps = [(k, f["pipeline"][k]) for k in ("reads", "copy", "sums", "gpu", "pwrite") if k in f["pipeline"]]
            rows.append((f"that transfer's steps apart ({f['threads']} threads): the reads alone, then + "
                         + ", + ".join(k for k, _ in steps[1:]) + " (into the one cache file)",
                         "; ".join(_step(v) for _, v in steps)))
            w = f["writes"]
            rows.append(("writes alone: into one file; one file per thread; one file mapped",
                         "; ".join(_step(w.get(k, {})) for k in ("pwrite_one_file", "pwrite_file_per_thread",
                                                                  "mapped_populated_one_file"))))
        peer = f.get("peer")
        if peer:
            rows.append(("a node with an empty cache from a peer's cache (Ray objects): plain reads; the load",
                         f"{_each([r['raw_ray']['GBps'] for r in peer['rounds']], 2, 'GB/s')}; **"
                         f"{_each([r['pipeline']['GBps'] for r in peer['rounds']], 2, 'GB/s')}**"))
        serve = f.get("serve")
        for label, key in (("a replica's start (Ray added -> RUNNING), the model on the node", "local"),
                           ("the same, the model at the source and an empty node cache", "remote_empty_cache"),
                           ("the same, the model at the source and in the node cache", "remote_node_copy")):
            if serve and serve.get("rounds"):
                v = _each([r[key]["start_to_running_s"] for r in serve["rounds"]], 2, "s")
                rows.append((label, f"**{v}**" if key == "remote_empty_cache" else v))
        own = [r for r in (serve or {}).get("rounds", []) if all("detail" in r[k] for k in
                                                                ("local", "remote_empty_cache", "remote_node_copy"))]
        if own:  # (Ray's own part of a start drifts by seconds between deploys: the replica's part apart)
            rows.append(("the replica's own part of those starts (its constructor to warm): the model on the node; "
                         "at the source (of it, the transfer); in the node cache",
                         _each([r["local"]["detail"]["total"] for r in own], 2, "s")
                         + "; " + _each([r["remote_empty_cache"]["detail"]["total"] for r in own], 2, "s")
                         + f" ({_each([r['remote_empty_cache']['detail'].get('fetch', 0) for r in own], 2, 's')}); "
                         + _each([r["remote_node_copy"]["detail"]["total"] for r in own], 2, "s")))
        for tag in ("defaults", "shipped", "interval-only"):
            z = [r for r in (serve or {}).get("scale_from_zero", []) if r["config"] == tag]
            if z:
                what = {"defaults": "Ray's autoscaling defaults", "shipped": "serve_config.zero.yaml's settings",
                        "interval-only": "only its metrics interval"}[tag]
                v = _each([r["first_answer_s"] for r in z], 2, "s")
                rows.append((f"scaled to zero, the first request's answer: {what}",
                             f"{'**' + v + '**' if tag == 'shipped' else v} (its replica added "
                             f"{_each([r['added_after_request_s'] for r in z], 2, 's')} after the request)"))
    return rows


def _quant(p: dict) -> list[tuple[str, str]]:
    """bench/quant.py's parts: a run's row per pack, and --sizes-only's whole-shape sizes."""
    rows = []
    runs = sum("rows" in f for f in p.values())  # more than one run of packs: each row names its part
    for name, f in p.items():
        if "load_build_s" in f:  # bench/engine.py over one whole pack
            rows.append((f"{name}: a whole pack ({_num(f['weight_gb'])} GB), the engine alone: warm load with its "
                         "build beside it; batch-1 decode",
                         f"{_num(f['load_build_s'])} s; **{_num(f['decode_ms_per_token_b1'])} ms/token** "
                         f"({_num(f['engine_share_decode_b1'])} of the GPU's bound, "
                         f"{_num(f['bound_decode_ms_per_token_b1'])} ms/token)"))
            continue
        if "quant" in f:  # bench/kernel_sweep.py --only quant
            rows += _quant_sweep(f["quant"])
            continue
        if "rows" not in f and "whole_sizes" not in f:  # a part of another shape: its numbers
            rows += _scalars(f, name if len(p) > 1 else "")
            continue
        shape = f.get("shape", "")
        for fmt, v in (f.get("whole_sizes") or {}).items():
            rows.append((f"a whole {shape}-shaped pack, {fmt}", f"{_num(v['whole_bytes'] / 1e9)} GB"))
        layers = f" ({f['layers']} of its layers)" if f.get("layers") else ""
        for r in f.get("rows", []):
            tps = _tokens_per_s(r)
            wide = max(tps) if tps else None
            rows.append((f"{name + ': ' if runs > 1 else ''}{shape}{layers}, {r['format']} ({_num(r['file_GB'])} GB): "
                         "warm load; batch-1 decode"
                         + (f"; {wide} requests at once" if wide else ""),
                         f"{_num(r['load_s'])} s; **{_num(r['decode_ms_per_token_b1'])} ms/token**"
                         + (f"; {_num(tps[wide], 0)} tokens/s" if wide else "") + f" ({r['kernels']})"))
    return rows


def _quant_sweep(q: dict) -> list[tuple[str, str]]:
    """The quantized layers' kernel sweep: per scheme and row count, each path's time per layer
    over the 7B's three projection shapes (the GEMV at its default blocks)."""
    by: dict[tuple[str, int], list[dict]] = {}
    for r in q.values():
        by.setdefault((r["scheme"], r["rows"]), []).append(r)
    rows = []
    for (scheme, m), rs in by.items():
        paths: dict[str, list[str]] = {"cuBLAS on the fp16 weight": [_num(r["cublas_fp16_ms"] * 1e3, 1) for r in rs]}
        for r in rs:
            seen = set()
            for path in r["paths"]:
                name = "GEMV" if path["path"].startswith("gemv") else path["path"]
                if name in seen:
                    continue  # the GEMV's first row is its default; the rest are the sweep's
                seen.add(name)
                paths.setdefault(name, []).append(_num(path["ms"] * 1e3, 1) if "ms" in path else "failed")
        shapes = " / ".join(f"{r['N']}x{r['K']}" for r in rs)
        rows.append((f"{scheme}, {m} row{'s' if m > 1 else ''}: us per layer ({shapes})",
                     "; ".join(f"{k} {' / '.join(v)}" for k, v in paths.items())))
    return rows


def _scalars(d: dict, prefix: str = "") -> list[tuple[str, str]]:
    """A part whose shape this file does not know: its numeric fields (a "summary" dict's where it has one)."""
    d = d.get("summary", d) if isinstance(d.get("summary"), dict) else d
    return [(f"{prefix + ': ' if prefix else ''}`{k}`", _num(v, 3 if abs(v) < 10 else 1))
            for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:12]


FIGURES: dict[str, Callable[[dict], list[tuple[str, str]]]] = {
    "tests": _tests, "load": _load, "engine": _engine, "kernels": _kernels, "serve": _serve,
    "fresh-node": _fresh_node, "http": _http, "tp": _tp, "fetch": _fetch, "quant": _quant}
WHAT = {"tests": "the GPU tests", "load": "weights onto the GPU", "engine": "the engine alone (tokens/s, decode)",
        "kernels": "where a step's device time goes", "serve": "a replica's start in Ray Serve",
        "fresh-node": "a new node's first replica", "http": "tokens/s through Ray Serve's HTTP front",
        "tp": "tensor parallelism", "fetch": "weights from object storage and other nodes",
        "quant": "quantized checkpoints"}


def read_results(results: Path = RESULTS) -> dict[str, dict]:
    """Every stage file under ``results``; a file that is not one (or lacks its fields) is an error."""
    found = {}
    for f in sorted(results.glob("*")):
        if f.is_dir():
            continue  # a stage's logs and runs' files (OUT/STAGE/), kept out of git
        if f.suffix != ".json" or f.stem not in STAGES:
            raise ValueError(f"{f}: not a stage's results file (bench/results holds STAGE.json for the stages "
                             f"{', '.join(STAGES)}); a run's other files belong in history, not the tree")
        d = json.loads(f.read_text())
        missing = [k for k in (*META, "parts") if k not in d]
        if missing or d.get("stage") != f.stem:
            raise ValueError(f"{f}: not written by `bench/results.py stage` (missing {missing or 'its stage name'})")
        found[f.stem] = d
    return found


def render(results: Path = RESULTS) -> str:
    """bench/RESULTS.md: each stage's current figures, its command, its file and where it ran."""
    found = read_results(results)
    md = ["# Benchmark results", "",
          "The current figures of each stage of `bench/gpu.sh`, from its one file under `bench/results/`, which",
          "each run of the stage overwrites (`bash bench/gpu.sh bench/results STAGE`). Earlier runs are in git's",
          "history (`git log -p -- bench/results/<stage>.json`); what each figure decided is in",
          "[docs/measurements.md](../docs/measurements.md). A stage's figures come from one host:",
          "compare within a stage, not across hosts.", "",
          "Made by `python bench/results.py` from those files: do not edit by hand "
          "(`tests/test_bench_results.py` fails when it is stale).", "",
          "| stage | what | measured on |", "| --- | --- | --- |"]
    for stage in STAGES:
        d = found.get(stage)
        where = f"{d['gpu']}, {d['time'][:10]}" if d else "not measured yet"
        md.append(f"| [{stage}](#{stage}) | {WHAT[stage]} | {where} |")
    for stage in STAGES:
        md += ["", f"## {stage}", ""]
        d = found.get(stage)
        if d is None:
            md.append(f"Not measured yet: `bash bench/gpu.sh bench/results {stage}`.")
            continue
        md += ["| figure | value |", "| --- | --- |"]
        md += [f"| {k} | {v} |" for k, v in FIGURES[stage](d["parts"])]
        md += ["", f"Command: `{d['command']}`  ", f"File: [bench/results/{stage}.json](results/{stage}.json)  ",
               f"Measured: {d['gpu']}, host {d['host']}, commit {d['commit']}, {d['time']}"]
        if d.get("note"):
            md += ["", d["note"]]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 where bench/RESULTS.md is stale")
    sub = ap.add_subparsers(dest="cmd")
    st = sub.add_parser("stage", help="write a stage's results file from its runs' JSON files")
    st.add_argument("stage", choices=STAGES)
    st.add_argument("out", type=Path)
    st.add_argument("--command", required=True, help="the gpu.sh command that ran it")
    st.add_argument("--part", action="append", default=[], metavar="NAME=FILE", help="a run's JSON file (repeated)")
    pc = sub.add_parser("pytest-counts", help="pytest's summary line in a log, as JSON")
    pc.add_argument("log", type=Path)
    pc.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "stage":
        bad = [p for p in a.part if "=" not in p]
        if bad:
            ap.error(f"--part {bad}: want NAME=FILE")
        res = assemble(a.stage, a.command, dict(p.split("=", 1) for p in a.part))
        tmp = a.out.with_suffix(".json.tmp")  # written whole, then renamed: never half a file in the tree
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(a.out)
        print(f"wrote {a.out}")
    elif a.cmd == "pytest-counts":
        a.out.write_text(json.dumps(pytest_counts(a.log.read_text())) + "\n")
    elif a.check:
        if not RESULTS_MD.is_file() or RESULTS_MD.read_text() != render():
            print("bench/RESULTS.md is stale against bench/results/: run `python bench/results.py`", file=sys.stderr)
            return 1
    else:
        RESULTS_MD.write_text(render())
        print(f"wrote {RESULTS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
