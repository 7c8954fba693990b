"""The cold-start report of ``bench/serve.py``: the goals judged on its measurements,
serve.json / serve.md, and coldstart-report.{json,md,png}."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from bench.meta import stamp

REPEATED = ("minimal", "minimal-cached", "minimal-early", "minimal-worker-cached", "coldstart")
# the goals: coldstart (as deployed, and with the worker-wide cache) against each floor
MINUS = (("coldstart", "minimal", "goal: + 2 s or less"),
         ("coldstart", "minimal-cached", "the same goal against a floor that compiles none of torch's modules either"),
         ("coldstart", "minimal-early",
          "the same goal against a floor that imports torch from the same worker setup hook"),
         ("coldstart-worker-cached", "minimal-worker-cached",
          "the same goal, both with the bytecode cache for the whole worker process"))
OVER = (("coldstart", "transformers", "goal: 1/3 or less"),
        ("coldstart", "transformers-cached",
         "the same goal against a transformers replica that compiles none of its modules either"),
        ("coldstart-worker-cached", "transformers",
         "the same goal with the worker-wide bytecode cache for coldstart only, as an operator would set it"),
        ("coldstart-worker-cached", "transformers-worker-cached",
         "the same goal, both with the worker-wide bytecode cache"))
# replicas whose engine computes as the default one does: their answers must all agree
SAME_ANSWER = ("coldstart", "coldstart-late", "coldstart-worker-cached", "coldstart-nokernels")


def _key(*parts: str) -> str:
    return "_".join(parts).replace("-", "_")


def paired(runs_s: dict[str, list[float]], ours: str, floor: str) -> list[float] | None:
    """``ours`` - ``floor`` in each round of the run (the kinds are deployed in turn, round after
    round), where both were deployed in at least three rounds: a host that slows down or speeds
    up over the run (Ray's worker start drifted by 2 s within one) shifts both alike, where the
    difference of the two medians mixes rounds."""
    a, b = runs_s.get(ours), runs_s.get(floor)
    if not a or not b or len(a) != len(b) or len(a) < 3:
        return None
    return [x - y for x, y in zip(a, b)]


def median_run(runs: list[dict]) -> dict:
    """The run with the median deploy -> warm time (the lower middle one of an even count)."""
    return sorted(runs, key=total)[(len(runs) - 1) // 2]


def _ours_phases(p: dict) -> dict:
    """coldstart's critical path: when the engine was built beside the load (load_wait
    recorded), its load share is what the main thread spent on the load: starting it (open,
    alloc, assemble: the buffer and its views, before the build) and waiting for the part the
    build did not hide. The load's whole time stays in the detail."""
    load = (p["load_wait"] + sum(p.get(k, 0.0) for k in ("open", "alloc", "assemble"))
            if "load_wait" in p else p["load"])
    return {"imports": p["imports"], "context": p["context"], "engine": p["engine"], "load": load,
            "warmup": p["warmup"]}


def total(r: dict) -> float:
    """The figure every goal is judged on: the replica's start as Ray reports it
    (``start_to_running_s``: from the controller adding the replica to the controller marking it
    RUNNING). Runs made before it was recorded (carried ones: the naive path) give deploy ->
    warm instead, from the serve.run call to the end of reconfigure, on the replica's clock."""
    return r.get("start_to_running_s", r["deploy_to_warm_s"])


def goal_lines(s: dict) -> list[str]:
    """The deployment's start-up goals, each with the figures of this run."""
    lines = []
    for ours, floor, goal in MINUS:
        d = s.get(_key(ours, "minus", floor, "warm", "s"))
        if d is not None:
            lines.append(f"- warm: {ours} = {floor} {'+' if d >= 0 else '-'} {abs(d):.2f} s "
                         f"({goal}: {'met' if d <= 2 else 'not met'})")
    for ours, floor, _ in MINUS:
        d = s.get(_key(ours, "minus", floor, "warm", "rounds", "s"))
        if d:
            m = statistics.median(d)
            lines.append(f"- warm, round by round: {ours} - {floor} = "
                         + ", ".join(f"{x:+.2f}" for x in d) + f" s; median {m:+.2f} s "
                         f"({'within' if m <= 2 else 'over'} the + 2 s goal)")
    for cache in ("warm", "cold"):
        for kind, d in s.get(f"variants_minus_coldstart_{cache}_rounds_s", {}).items():
            lines.append(f"- {cache}, round by round: {kind} - coldstart = " + ", ".join(f"{x:+.2f}" for x in d)
                         + f" s; median {statistics.median(d):+.2f} s (a variant against the default)")
    for ours, floor, goal in OVER:
        r = s.get(_key(ours, "over", floor, "warm"))
        if r is not None:
            lines.append(f"- warm: {ours} = {r:.2f} of {floor} ({goal}: {'met' if r <= 1 / 3 else 'not met'})")
    if "cold_goal_s" in s and "coldstart_cold_s" in s:
        c, g = s["coldstart_cold_s"], s["cold_goal_s"]
        lines.append(f"- cold: coldstart {c:.2f} s vs minimal + the disk's time for the weights "
                     f"({s['disk_read_s']:.2f} s at {s['disk_GBps']:.2f} GB/s) = {g:.2f} s: "
                     f"{'met' if c <= g else 'not met'}")
    if "cold_goal_cached_s" in s and "coldstart_cold_s" in s:
        c, g = s["coldstart_cold_s"], s["cold_goal_cached_s"]
        lines.append(f"- cold: coldstart {c:.2f} s vs minimal-cached + the disk's time = {g:.2f} s: "
                     f"{'met' if c <= g else 'not met'}")
    if "fresh_node_goal_s" in s and "fresh_node_s" in s:
        c, g = s["fresh_node_s"], s["fresh_node_goal_s"]
        lines.append(f"- new node: coldstart {c:.2f} s vs minimal on the same fresh node + the disk's time + 1 s "
                     f"= {g:.2f} s: {'met' if c <= g else 'not met'}"
                     + (f"; without the shipped kernels {s['fresh_node_no_kernels_s']:.2f} s"
                        if "fresh_node_no_kernels_s" in s else ""))
    if "answers_agree" in s:
        lines.append(f"- every coldstart replica of the run ({s['answers']} starts) gave the same "
                     "greedy answer: " + ("yes" if s["answers_agree"] else
                                          "NO: a replica served wrong tokens, and its time does not count"))
    return lines


def write_report(res: dict, out: Path, command: str) -> None:
    """coldstart-report.{json,md,png}: the table and a stacked bar per run."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "coldstart-report.json").write_text(json.dumps({"command": command, **res}, indent=2))
    order = ["ray_and_process", "imports", "context", "engine", "load", "warmup", "ready"]
    rows = ["| replica | cache | added -> RUNNING s (Ray) | deploy -> warm s | first 200 s after deploy | "
            + " | ".join(f"{k} %" for k in order) + " |", "|---" * (5 + len(order)) + "|"]
    runs = [(kind, cache, r) for cache in ("warm", "cold") for kind, r in res.get(cache, {}).items()]
    for kind, cache, r in runs:
        tot = total(r)
        shares = [f"{100 * r['phases'].get(k, 0) / tot:.0f}" for k in order]
        ray_s = f"{r['start_to_running_s']:.2f}" if "start_to_running_s" in r else "not recorded"
        rows.append(f"| {kind}{' *' if r.get('measured_in') else ''} | {cache} | {ray_s} | "
                    f"{r['deploy_to_warm_s']:.2f} | "
                    f"{r['deploy_to_first_200_s']:.2f} | "
                    + " | ".join(shares) + " |")
    notes = []
    if any(kind == "coldstart" and "load_wait" in (r.get("detail") or {}) for kind, _, r in runs):
        notes.append("coldstart builds its engine while the weights load: its load share is the main "
                     "thread's time on the load, starting it (the device buffer and its views) and waiting "
                     "for what the build did not hide (the load's whole time is `detail.load` in the "
                     "JSON).\n\n")
    if any(kind == "naive" for kind, _, _ in runs):
        notes.append("naive: its load phase is the article's path, random init on the CPU + `load_state_dict` "
                     "from the shards + `.half().cuda()`.\n\n")
    for kind, cache, r in runs:
        if r.get("measured_in"):
            notes.append(f"\\* {kind}, {cache} cache: from another run ({r['measured_in']})"
                         + ("" if "start_to_running_s" in r else ", deploy -> warm") + ".\n\n")
    missing = [k for k in res.get("warm", {}) if res.get("cold") and k not in res["cold"]]
    if missing:
        notes.append(f"Not measured with a cold cache in this run: {', '.join(missing)}.\n\n")
    (out / "coldstart-report.md").write_text(
        "Replica start in Ray Serve, each replica alone on the GPU: from the controller adding "
        "the replica to the controller marking it RUNNING, as Ray reports a replica's startup "
        "(the goals are judged on it); beside it, from the serve.run call to the replica warm on "
        "its own clock, and to the first 200 answer. Phase shares of the first (ready: after "
        "reconfigure, Ray's gc.collect(), the first health check and the controller's loop; "
        "runs without Ray's figure: of deploy -> warm).\n\n"
        + "\n".join(rows) + "\n\n" + "".join(notes) + f"Command: `{command}`\n")
    if not runs:  # (a run of fresh-node starts alone: the table has them, the chart is of warm and cold)
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG chart", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(runs)))
    colors = ["#bbbbbb", "#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3", "#a6d854", "#ffd92f"]
    assert len(colors) == len(order)
    labels = [f"{kind} ({cache}){' *' if r.get('measured_in') else ''}" for kind, cache, r in runs]
    # a start of minutes (the naive path) would squash every other bar: cut it at the axis
    totals = [total(r) for _, _, r in runs]
    short = [t for t in totals if t < max(totals) / 3]  # the naive path's warm and cold bars are both cut
    xmax = 1.4 * max(short) if short else max(totals)
    for i, (kind, cache, r) in enumerate(runs):
        left = 0.0
        for k, c in zip(order, colors):
            w = r["phases"].get(k, 0.0)
            ax.barh(i, w, left=left, color=c, label=k if i == 0 else None)
            left += w
        if left > xmax:  # the label inside the cut bar's end
            ax.text(xmax, i, f"{total(r):.1f} s (bar cut) ", va="center", ha="right", fontsize=8,
                    bbox=dict(facecolor="white", edgecolor="none", pad=1))
        else:
            ax.text(left + 0.3, i, f"{total(r):.1f} s", va="center", fontsize=8)
    ax.set_xlim(0, xmax + 4)
    ax.set_yticks(range(len(runs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the controller adding the replica to RUNNING")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "coldstart-report.png", dpi=120)


def finish(res: dict, out_dir: str, report_dir: str | None, command: str) -> None:
    """serve.json / serve.md (and the report) from the measurements in ``res``."""
    summary: dict = {}
    if "scale_up" in res:
        summary["scale_up_decision_to_first_answer_s"] = res["scale_up"]["decision_to_first_answer_s"]
    if "disk" in res:
        disk_s = res["disk"]["nbytes"] / 1e9 / res["disk"]["GBps"]
        summary["disk_GBps"], summary["disk_read_s"] = res["disk"]["GBps"], disk_s
        if "minimal" in res.get("cold", {}):
            summary["cold_goal_s"] = total(res["cold"]["minimal"]) + disk_s
        if "minimal-cached" in res.get("cold", {}):
            summary["cold_goal_cached_s"] = total(res["cold"]["minimal-cached"]) + disk_s
    fresh = res.get("fresh", {})
    for kind, key in (("coldstart", "fresh_node_s"), ("minimal", "fresh_node_minimal_s"),
                      ("coldstart-nokernels", "fresh_node_no_kernels_s")):
        if kind in fresh:
            summary[key] = total(fresh[kind])
    if "fresh_node_minimal_s" in summary and "disk_read_s" in summary:
        summary["fresh_node_goal_s"] = summary["fresh_node_minimal_s"] + summary["disk_read_s"] + 1.0
    for cache in ("warm", "cold"):
        r = res.get(cache, {})
        for kind, v in r.items():
            summary[f"{kind}_{cache}_s"] = total(v)
        rounds = res.get(f"{cache}_runs_s", {})
        for ours, floor, _ in MINUS:  # against each floor measured in the run
            if ours in r and floor in r:
                summary[_key(ours, "minus", floor, cache, "s")] = (
                    total(r[ours]) - total(r[floor]))
            d = paired(rounds, ours, floor)  # and round by round, where both were deployed in every round
            if d:
                summary[_key(ours, "minus", floor, cache, "rounds", "s")] = d
        for ours, floor, _ in OVER:
            if ours in r and floor in r:
                summary[_key(ours, "over", floor, cache)] = total(r[ours]) / total(r[floor])
        for kind in rounds:  # a variant (--variant NAME: kind coldstart-NAME) against the default
            d = paired(rounds, kind, "coldstart") if kind.startswith("coldstart-") else None
            if d and kind not in (ours for ours, _, _ in MINUS):
                summary.setdefault(f"variants_minus_coldstart_{cache}_rounds_s", {})[kind] = d
    # a variant (--variant) may compute otherwise (torch kernels instead of Triton's): only the
    # default replica's starts are held to one answer
    answers = [a["token_ids"] for a in res.get("answers", []) if a["kind"] in SAME_ANSWER]
    if answers:  # greedy, one prompt, one checkpoint: every start must answer alike
        summary["answers"] = len(answers)
        summary["answers_agree"] = all(a == answers[0] for a in answers)
    summary["command"] = command
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(stamp({**summary, "detail": res}), indent=2))
    md = ["A replica's start as Ray reports it: from the controller adding the replica to the controller "
          "marking it RUNNING (constructor, reconfigure, Ray's gc.collect() and first health check done), "
          "each deployment alone. Runs without that figure (carried from runs before it was recorded) give "
          "deploy -> replica warm.", "",
          "| replica | warm cache s | cold cache s | fresh node s |", "|---|---|---|---|"]
    def cell(cache: str, k: str) -> str:
        r = res.get(cache, {}).get(k)
        if r is None:
            return ""
        return f"{total(r):.2f}" + (f" (from another run: {r['measured_in']})"
                                                 if r.get("measured_in") else "")
    for k in dict.fromkeys([*res.get("warm", {}), *res.get("cold", {}), *res.get("fresh", {})]):
        md.append(f"| {k} | {cell('warm', k)} | {cell('cold', k)} | {cell('fresh', k)} |")
    missing = [k for k in res.get("warm", {}) if res.get("cold") and k not in res["cold"]]
    if missing:
        md.append(f"Not measured with a cold cache in this run: {', '.join(missing)}.")
    for cache in ("warm", "cold", "fresh"):
        for k, ts in res.get(f"{cache}_runs_s", {}).items():
            md.append(f"{k}, {cache} cache: {len(ts)} deploys, {', '.join(f'{t:.2f}' for t in ts)} s; the median counts.")
    md += [""] + goal_lines(summary)
    def rounded(v: object) -> object:
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return v if isinstance(v, bool) else [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)
    md += ["", json.dumps({k: rounded(v) for k, v in summary.items() if k != "command"}), "",
           f"Command: `{command}`", ""]
    (out / "serve.md").write_text("\n".join(md))
    print("\n".join(md))
    if report_dir:
        write_report(res, Path(report_dir), command)
