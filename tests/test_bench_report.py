"""bench/serve.py's report: serve.json / serve.md and coldstart-report.{json,md,png} from the
measurements a run made, including one that was cut short before every cold run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _run(total: float, **phases: float) -> dict:
    return {"deploy_to_warm_s": total, "deploy_to_running_s": total + 0.5, "deploy_to_first_200_s": total + 0.6,
            "process_to_warm_s": total, "phases": phases, "detail": None}


@pytest.fixture
def partial(tmp_path) -> Path:
    res = {
        "warm": {"minimal": _run(7.0, ray_and_process=4.0, imports=2.7, context=0.3),
                 "coldstart": _run(10.0, ray_and_process=3.5, imports=3.4, load=0.5, engine=2.0, warmup=0.6),
                 "transformers": _run(18.0, ray_and_process=3.7, imports=10.5, load=2.2, warmup=1.6),
                 "naive": _run(280.0, ray_and_process=4.0, imports=10.0, load=264.0, warmup=2.0)},
        "cold": {"minimal": _run(9.5, ray_and_process=5.5, imports=3.5, context=0.5),
                 "coldstart": _run(16.0, ray_and_process=6.0, imports=5.0, load=3.0, engine=1.5, warmup=0.5),
                 "transformers": _run(27.0, ray_and_process=4.5, imports=11.0, load=9.0, warmup=2.5)},
        "disk": {"GBps": 2.0, "nbytes": 13_400_000_000},
        "command": "PYTHONPATH=$PWD python bench/serve.py --naive",
    }
    p = tmp_path / "serve-partial.json"
    p.write_text(json.dumps(res))
    return p


def test_report_from_a_cut_short_run(partial, tmp_path, monkeypatch):
    from bench import serve as bench_serve

    out, docs = tmp_path / "results", tmp_path / "docs"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--from-partial", str(partial), "--out", str(out),
                                      "--report", str(docs)])
    bench_serve.main()
    s = json.loads((out / "serve.json").read_text())
    assert s["coldstart_minus_minimal_warm_s"] == pytest.approx(3.0)
    assert s["coldstart_over_transformers_warm"] == pytest.approx(10 / 18)
    assert s["cold_goal_s"] == pytest.approx(9.5 + 6.7)  # minimal cold + 13.4 GB at 2 GB/s
    assert s["command"] == "PYTHONPATH=$PWD python bench/serve.py --naive"
    md = (out / "serve.md").read_text()
    assert "| naive | 280.00 |  |" in md and "Not measured with a cold cache in this run: naive" in md
    assert "minimal + 3.00 s (goal: + 2 s or less: not met)" in md
    assert "= 16.20 s: met" in md  # 16.0 s cold against 16.2 s
    report = (docs / "coldstart-report.md").read_text()
    assert report.count("\n| ") == 1 + 7  # the header and one row per measured run
    assert "random init on the CPU" in report
    png = (docs / "coldstart-report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_phases_of_an_engine_built_beside_the_load_are_its_critical_path():
    from bench.serve_report import _ours_phases

    detail = {"imports": 3.0, "context": 0.2, "load": 0.5, "engine": 1.2, "load_wait": 0.05, "warmup": 0.4,
              "engine_model": 0.6, "open": 0.01, "alloc": 0.02, "assemble": 0.03, "read_copy": 0.4}
    # the main thread's share of the load: starting it (open, alloc, assemble) and its wait
    assert _ours_phases(detail) == pytest.approx(
        {"imports": 3.0, "context": 0.2, "engine": 1.2, "load": 0.11, "warmup": 0.4})
    sequential = dict(detail)
    del sequential["load_wait"]
    assert _ours_phases(sequential)["load"] == 0.5


def test_the_median_deploy_counts():
    from bench.serve_report import median_run

    runs = [{"deploy_to_warm_s": t} for t in (12.7, 11.9, 14.2)]
    assert median_run(runs)["deploy_to_warm_s"] == 12.7
    assert median_run(runs[:2])["deploy_to_warm_s"] == 11.9  # the lower middle of an even count
    assert median_run(runs[:1]) is runs[0]


def _bytes_read_by_this_process() -> int:
    """rchar of /proc/self/io: the bytes this process asked read(2) for, cached or not."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_warm_cache_leaves_the_files_in_the_page_cache(tmp_path):
    import os

    from bench.load import warm_cache
    from deployments.tools.doctor import drop_page_cache
    from weights.readahead import resident_fraction

    if not Path("/proc/self/io").exists():
        pytest.skip("no /proc/self/io here")
    size = 80 << 20
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(size))
    drop_page_cache([f])
    before = resident_fraction(f, samples=256)
    if before is None or before > 0.5:
        pytest.skip("this filesystem keeps the file cached (or mincore is unavailable)")
    read0 = _bytes_read_by_this_process()
    warm_cache(tmp_path)
    assert _bytes_read_by_this_process() - read0 >= size  # read once, whole
    # all of it cached, but for the few pages the kernel may reclaim at once under the memory
    # the rest of the suite holds
    assert resident_fraction(f, samples=256) >= 31 / 32
    cached = resident_fraction(f, samples=256) >= 0.999
    read1 = _bytes_read_by_this_process()
    warm_cache(tmp_path)  # resident already: sampled, not read again
    again = _bytes_read_by_this_process() - read1
    assert again < (1 << 20) if cached else again >= size


def test_a_run_from_another_run_is_marked(partial, tmp_path, monkeypatch):
    from bench import serve as bench_serve

    res = json.loads(partial.read_text())
    res["warm"]["naive"]["measured_in"] = "yesterday's run"
    partial.write_text(json.dumps(res))
    out, docs = tmp_path / "results", tmp_path / "docs"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--from-partial", str(partial), "--out", str(out),
                                      "--report", str(docs)])
    bench_serve.main()
    assert "| naive | 280.00 (from another run: yesterday's run) |  |" in (out / "serve.md").read_text()
    report = (docs / "coldstart-report.md").read_text()
    assert "| naive * | warm | not recorded | 280.00 |" in report
    assert "naive, warm cache: from another run (yesterday's run), deploy -> warm." in report
    assert "| coldstart | warm | not recorded | 10.00 |" in report  # the others unmarked


@pytest.mark.parametrize("agree", [True, False])
def test_every_coldstart_start_must_give_the_same_answer(partial, tmp_path, monkeypatch, agree):
    """A replica that serves wrong tokens (a cold one decoding garbage, say) is flagged, so
    that its start time is not taken for a result."""
    from bench import serve as bench_serve

    res = json.loads(partial.read_text())
    good = [306, 1234, 29889]
    res["answers"] = [{"kind": "coldstart", "cache": c, "token_ids": good} for c in ("warm", "warm", "cold")]
    if not agree:
        res["answers"][2]["token_ids"] = [306, 0, 0]
    # a variant computes otherwise (torch kernels, say): its answer is not held to the others
    res["answers"].append({"kind": "coldstart-notriton", "cache": "warm", "token_ids": [306, 1234, 7]})
    partial.write_text(json.dumps(res))
    out = tmp_path / "results"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--from-partial", str(partial), "--out", str(out)])
    bench_serve.main()
    s = json.loads((out / "serve.json").read_text())
    assert s["answers"] == 3 and s["answers_agree"] is agree
    md = (out / "serve.md").read_text()
    line = "- every coldstart replica of the run (3 starts) gave the same greedy answer: "
    assert line + ("yes" if agree else "NO: a replica served wrong tokens") in md
    assert f'"answers_agree": {str(agree).lower()}' in md


def test_the_minimal_replica_with_the_bytecode_cache_is_a_second_floor(partial, tmp_path, monkeypatch):
    """Where the interpreter keeps no .pyc of its own, coldstart's replica keeps them per node;
    the report then also compares it with a minimal replica that does the same, warm and cold."""
    from bench import serve as bench_serve

    res = json.loads(partial.read_text())
    res["warm"]["minimal-cached"] = _run(8.5, ray_and_process=4.0, imports=1.2, context=0.3)
    res["cold"]["minimal-cached"] = _run(9.0, ray_and_process=5.5, imports=3.0, context=0.5)
    res["warm"]["coldstart"]["deploy_to_warm_s"] = 6.5
    partial.write_text(json.dumps(res))
    out = tmp_path / "results"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--from-partial", str(partial), "--out", str(out)])
    bench_serve.main()
    s = json.loads((out / "serve.json").read_text())
    assert s["coldstart_minus_minimal_warm_s"] == pytest.approx(-0.5)
    assert s["coldstart_minus_minimal_cached_warm_s"] == pytest.approx(-2.0)
    assert s["cold_goal_cached_s"] == pytest.approx(9.0 + 6.7)
    md = (out / "serve.md").read_text()
    assert "coldstart = minimal - 0.50 s (goal: + 2 s or less: met)" in md
    assert "coldstart = minimal-cached - 2.00 s (the same goal against a floor" in md
    assert "cold: coldstart 16.00 s vs minimal-cached + the disk's time = 15.70 s: not met" in md


def test_round_by_round_differences_cancel_the_hosts_drift(partial, tmp_path, monkeypatch):
    """Kinds deployed in turn for several rounds: each round's difference is reported too, and
    their median, beside the difference of the medians (which here mixes a slow and a fast round)."""
    from bench import serve as bench_serve

    res = json.loads(partial.read_text())
    res["warm_runs_s"] = {"minimal": [9.0, 8.0, 6.0], "coldstart": [10.5, 9.0, 7.0],
                          "transformers": [18.0]}
    partial.write_text(json.dumps(res))
    out = tmp_path / "results"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--from-partial", str(partial), "--out", str(out)])
    bench_serve.main()
    s = json.loads((out / "serve.json").read_text())
    assert s["coldstart_minus_minimal_warm_rounds_s"] == pytest.approx([1.5, 1.0, 1.0])
    assert "coldstart_minus_minimal_cached_warm_rounds_s" not in s  # no minimal-cached rounds
    md = (out / "serve.md").read_text()
    assert "- warm, round by round: coldstart - minimal = +1.50, +1.00, +1.00 s; median +1.00 s " \
           "(within the + 2 s goal)" in md
    assert "coldstart = minimal + 3.00 s (goal: + 2 s or less: not met)" in md  # the medians' line stays


def test_a_variant_is_compared_with_the_default_round_by_round(partial, tmp_path, monkeypatch):
    from bench import serve as bench_serve

    res = json.loads(partial.read_text())
    res["warm"]["coldstart-hold"] = _run(9.0, ray_and_process=3.5, imports=3.4, load=0.5, engine=1.0, warmup=0.6)
    res["warm_runs_s"] = {"coldstart": [10.5, 9.0, 7.0], "coldstart-hold": [10.0, 8.0, 7.5],
                          "coldstart-worker-cached": [8.0, 7.0, 6.0]}
    partial.write_text(json.dumps(res))
    out = tmp_path / "results"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--from-partial", str(partial), "--out", str(out)])
    bench_serve.main()
    s = json.loads((out / "serve.json").read_text())
    v = s["variants_minus_coldstart_warm_rounds_s"]
    assert v["coldstart-hold"] == pytest.approx([-0.5, -1.0, 0.5])
    assert "coldstart-worker-cached" not in v  # compared with its own floor
    md = (out / "serve.md").read_text()
    assert "- warm, round by round: coldstart-hold - coldstart = -0.50, -1.00, +0.50 s; median -0.50 s" in md
    assert "- cold, round by round" not in md  # no cold rounds in this run


def test_rounds_need_three_of_each():
    from bench.serve_report import paired

    assert paired({"a": [1.0, 2.0], "b": [0.5, 1.0]}, "a", "b") is None
    assert paired({"a": [1.0, 2.0, 3.0], "b": [0.5, 1.0]}, "a", "b") is None
    assert paired({"a": [1.0, 2.0, 3.0]}, "a", "b") is None
    assert paired({"a": [1.0, 2.0, 3.0], "b": [0.5, 1.0, 4.0]}, "a", "b") == [0.5, 1.0, -1.0]


def test_the_goals_are_judged_on_the_window_ray_reports_where_it_was_recorded(partial, tmp_path, monkeypatch):
    """A run that recorded Ray's own window (the controller adding the replica -> RUNNING) is
    judged on it; one carried from before (deploy -> warm only) keeps its own figure."""
    from bench import serve as bench_serve

    res = json.loads(partial.read_text())
    res["warm"]["coldstart"].update(start_to_running_s=6.0)
    res["warm"]["coldstart"]["phases"]["ready"] = 0.3
    res["warm"]["transformers"].update(start_to_running_s=17.5)
    res["warm"]["minimal"].update(start_to_running_s=6.5)
    partial.write_text(json.dumps(res))
    out, docs = tmp_path / "results", tmp_path / "docs"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--from-partial", str(partial), "--out", str(out),
                                      "--report", str(docs)])
    bench_serve.main()
    s = json.loads((out / "serve.json").read_text())
    assert s["coldstart_warm_s"] == 6.0 and s["naive_warm_s"] == 280.0
    assert s["coldstart_over_transformers_warm"] == pytest.approx(6.0 / 17.5)
    assert s["coldstart_minus_minimal_warm_s"] == pytest.approx(-0.5)
    assert "coldstart = 0.34 of transformers (goal: 1/3 or less: not met)" in (out / "serve.md").read_text()
    report = (docs / "coldstart-report.md").read_text()
    assert "| coldstart | warm | 6.00 | 10.00 | 10.60 | 58 | 57 |" in report  # shares of the 6.0 s
    assert report.split("| coldstart | warm |")[1].split("\n")[0].rstrip().endswith("| 5 |")  # ready


# a line of Ray 2.60's controller log, as it marks a replica RUNNING
_LINE = ("INFO 2026-12-02 07:31:18,041 controller 4738 -- Replica(id='rfb85xm3', deployment='LLMDeployment', "
         "app='x') started successfully on node '86ebacef50937a2a9f33a669ac6cd52b9e0db33956709db587bcbed2' "
         "after 4.0s (PID: 4814). Replica constructor, reconfigure method, and initial health check took 2.2s.\n")


def test_the_controllers_start_line_gives_when_the_replica_was_running(tmp_path):
    import datetime

    from bench.serve import controller_running_at

    (tmp_path / "controller_4738.log").write_text(
        "INFO 2026-12-02 07:31:14,000 controller 4738 -- Adding 1 replica to Deployment(name='LLMDeployment', app='x').\n"
        + _LINE.replace("'rfb85xm3'", "'other'") + _LINE)
    at, logged = controller_running_at(tmp_path, "x", "rfb85xm3", timeout=0)
    assert at == datetime.datetime(2026, 12, 2, 7, 31, 18, 41000).timestamp() and logged == 4.0
    assert controller_running_at(tmp_path, "y", "rfb85xm3", timeout=0) is None  # another app's replica
    assert controller_running_at(tmp_path, "x", "nothere", timeout=0) is None


@pytest.mark.parametrize("n", [16, 40, 128])
def test_the_http_benchmark_sends_prompts_of_the_engine_runs_length(tiny_packed, n):
    """Each prompt is ``n`` tokens as the replica counts them (its BOS included) and begins with
    a number of its own: the same prefill length as the engine's prompts, no shared prefix."""
    from bench.throughput import prompt_texts
    from deployments.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_packed)
    texts = prompt_texts(tiny_packed, n, 12)
    assert [len(tok.encode(t)) for t in texts] == [n] * 12
    assert len({t.split(".")[0] for t in texts}) == 12


def test_a_report_of_fresh_node_starts_alone_is_written(tmp_path):
    """A run of the fresh-node stage alone (no warm or cold starts to chart) still writes its report."""
    from bench.serve_report import write_report
    res = {"fresh": {"minimal": _run(7.7, ray_and_process=3.9, imports=3.0),
                     "coldstart": _run(16.4, ray_and_process=6.1, imports=1.0, engine=3.6, load=4.8)}}
    write_report(res, tmp_path, "bench/serve.py --caches fresh")
    assert json.loads((tmp_path / "coldstart-report.json").read_text())["fresh"]["coldstart"]
    assert (tmp_path / "coldstart-report.md").is_file() and not (tmp_path / "coldstart-report.png").exists()
