"""The fleet report: every job's row (its replay report's figures, the machine it ran on, attempts and errors),
fleet-wide distributions, the worst jobs first; as fleet.json and a self-contained fleet.html. And the regression
gate between two fleet reports (`vla-node fleet compare`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from vla_node.report.html import STYLE, _e
from vla_node.report.report import grew_beyond, percent_change
from vla_node.validate import ConfigError, is_number, require

DISTRIBUTED = ("latency_p50_ms", "latency_p99_ms", "deadline_misses", "jitter_p99_ms", "reuse_ratio")
FLEET_KEYS = ("fleet", "distributions", "rows")


def _worst_first(row: Mapping[str, Any]) -> tuple:
    """Failed jobs first, then the highest p99 latency (a job without one after those with one)."""
    p99 = None if row["figures"] is None else row["figures"]["latency_p99_ms"]
    return (row["status"] == "ok", p99 is None, -(p99 or 0.0), row["job"])


def build_fleet_report(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> dict[str, Any]:
    """fleet.json's dict from the jobs' rows and the run's meta (launch, mode, ...)."""
    ok = [r for r in rows if r["status"] == "ok"]
    distributions = {}
    for key in DISTRIBUTED:
        values = np.array([r["figures"][key] for r in ok if r["figures"][key] is not None], dtype=float)
        distributions[key] = None if values.size == 0 else {
            "p50": round(float(np.percentile(values, 50)), 3), "p90": round(float(np.percentile(values, 90)), 3),
            "max": round(float(values.max()), 3), "n": int(values.size)}
    fleet = {
        **meta, "jobs": len(rows), "drives": len({r["drive_id"] for r in rows}), "ok": len(ok),
        "failed": len(rows) - len(ok), "retried": sum(1 for r in rows if r["attempts"] > 1),
        "machines": sorted({r["machine"]["host"] for r in ok}),
        "started_ns": min((r["start_ns"] for r in ok), default=None),
        "ended_ns": max((r["end_ns"] for r in ok), default=None),
    }
    return {"fleet": fleet, "distributions": distributions, "rows": sorted(rows, key=_worst_first)}


def load_fleet_report(path: str | Path) -> dict[str, Any]:
    """A fleet.json, checked for its keys (ConfigError naming the file otherwise)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable fleet report ({e})") from None
    require(isinstance(data, dict) and all(k in data for k in FLEET_KEYS), str(path), "...",
            f"a fleet report with keys {list(FLEET_KEYS)}")
    return data


def write_fleet_report(report: Mapping[str, Any], out: Path) -> tuple[Path, Path]:
    """out/fleet.json and out/fleet.html."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "fleet.json", out / "fleet.html"
    json_path.write_text(json.dumps(report, indent=1))
    html_path.write_text(render_fleet_html(report))
    return json_path, html_path


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def render_fleet_html(report: Mapping[str, Any]) -> str:
    """The fleet page: the run, the distributions, every job worst first (every string escaped)."""
    fleet = report["fleet"]
    head = "".join(f'<tr><th>{_e(k)}</th><td class="num">{_e(_num(v) if not isinstance(v, list) else ", ".join(map(str, v)))}'
                   f"</td></tr>" for k, v in fleet.items())
    dist = "".join(f"<tr><th>{_e(k)}</th>" + "".join(f'<td class="num">{_e(_num((d or {}).get(q)))}</td>'
                                                   for q in ("p50", "p90", "max", "n")) + "</tr>"
                   for k, d in report["distributions"].items())
    columns = ("job", "status", "attempts", "host", "cpu", "backend", "p50 ms", "p99 ms", "misses", "jitter p99",
               "reuse", "errors")
    rows = []
    for r in report["rows"]:
        f, m = r["figures"] or {}, r["machine"] or {}
        cells = (r["job"], r["status"], r["attempts"], m.get("host"), m.get("cpu"), r["backend"],
                 f.get("latency_p50_ms"), f.get("latency_p99_ms"), f.get("deadline_misses"), f.get("jitter_p99_ms"),
                 f.get("reuse_ratio"), "; ".join(r["errors"]))
        style = ' style="background:#fde0dc"' if r["status"] != "ok" else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{_e(_num(c))}</td>" for c in cells) + "</tr>")
    table = "<tr>" + "".join(f"<th>{_e(c)}</th>" for c in columns) + "</tr>" + "".join(rows)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>vla-node fleet report</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n<h1>vla-node fleet report: {fleet['jobs']} jobs, "
            f"{fleet['drives']} drives</h1>\n<table class=\"summary\">{head}</table>\n"
            f"<h2>Distributions over the jobs (ok ones)</h2>\n<table><tr><th></th><th>p50</th><th>p90</th><th>max</th>"
            f"<th>n</th></tr>{dist}</table>\n<h2>Jobs, worst first</h2>\n<table>{table}</table>\n</body>\n</html>\n")


def action_deviation(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[float | None, int]:
    """Mean absolute difference of the fresh actions two runs of one drive made for the same frames, and how many
    frames both ran (None when none)."""
    common = sorted(set(a["fresh_actions"]) & set(b["fresh_actions"]), key=int)
    if not common:
        return None, 0
    va = np.array([a["fresh_actions"][k] for k in common], dtype=float)
    vb = np.array([b["fresh_actions"][k] for k in common], dtype=float)
    return float(np.abs(va - vb).mean()), len(common)


def compare_fleets(base: Mapping[str, Any], new: Mapping[str, Any], max_regression_pct: float,
                   max_action_deviation: float | None = None) -> tuple[str, list[str]]:
    """Per job in base: its p99 latency, deadline misses and (where both ran the same frames) action deviation in
    new. Regressions: a job failed or missing in new that was ok in base, p99 grown past max_regression_pct,
    misses grown (past the bound, or any from 0), the deviation past max_action_deviation. (text, regressions)."""
    require(is_number(max_regression_pct) and max_regression_pct >= 0, "max_regression_pct", max_regression_pct,
            "a finite number >= 0")
    require(max_action_deviation is None or (is_number(max_action_deviation) and max_action_deviation >= 0),
            "max_action_deviation", max_action_deviation, "a finite number >= 0 or unset")
    pct = float(max_regression_pct)
    by_job = {r["job"]: r for r in new["rows"]}
    lines = [f"{'job':<32} {'p99 base':>9} {'p99 new':>9} {'change':>8} {'misses':>9} {'action dev':>11}"]
    regressions: list[str] = []
    for a in sorted(base["rows"], key=lambda r: r["job"]):
        job, b = a["job"], by_job.get(a["job"])
        if a["status"] != "ok":
            lines.append(f"{job:<32} (failed in base: not compared)")
            continue
        if b is None or b["status"] != "ok":
            why = "missing" if b is None else f"failed: {'; '.join(b['errors'])[:200]}"
            regressions.append(f"{job}: {why} in new")
            lines.append(f"{job:<32} {why} in new")
            continue
        fa, fb = a["figures"], b["figures"]
        p99a, p99b = fa["latency_p99_ms"], fb["latency_p99_ms"]
        change = percent_change(p99a, p99b)
        deviation, frames = action_deviation(a, b)
        lines.append(f"{job:<32} {_num(p99a):>9} {_num(p99b):>9} {change:>8} "
                     f"{fa['deadline_misses']:>4}->{fb['deadline_misses']:<4} "
                     f"{'-' if deviation is None else f'{deviation:.4f} ({frames})':>11}")
        if p99a is not None and (p99b is None or grew_beyond(p99a, p99b, pct)):
            regressions.append(f"{job}: p99 latency {_num(p99a)} -> {_num(p99b)} ms (bound {pct:g}%)")
        ma, mb = fa["deadline_misses"], fb["deadline_misses"]
        if grew_beyond(ma, mb, pct):
            regressions.append(f"{job}: deadline misses {ma} -> {mb}" + (" (any increase from 0)" if ma == 0 else
                                                                        f" (bound {pct:g}%)"))
        if max_action_deviation is not None and deviation is not None and deviation > max_action_deviation:
            regressions.append(f"{job}: action deviation {deviation:.4f} over {frames} frames "
                               f"(bound {max_action_deviation:g})")
    extra = sorted(set(by_job) - {r["job"] for r in base["rows"]})
    if extra:
        lines.append(f"in new only (not compared): {', '.join(extra)}")
    lines.append("REGRESSED:\n  " + "\n  ".join(regressions) if regressions else
                 f"OK: no job regressed (p99 and misses within {pct:g}%"
                 + (f", action deviation within {max_action_deviation:g})" if max_action_deviation is not None else ")"))
    return "\n".join(lines), regressions
