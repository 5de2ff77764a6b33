"""bench all's report: bench.md (tables) and bench.html (the same tables and plots: per-stage time by backend,
ratio to floor, the node run's latency distribution), both from bench.json's figures alone."""

from __future__ import annotations

import html
from typing import Sequence

import numpy as np

from vla_node.bench import floor

BAR_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def _table(rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table: the first row is the header."""
    cells = [[str(v) for v in row] for row in rows]
    return ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0]),
            *("| " + " | ".join(row) + " |" for row in cells[1:])]


def _short(value: object) -> object:
    """A float to 4 significant digits for a table; anything else as it is."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _met(t: dict) -> str:
    return "met" if t["met"] else "**missed**"


def _sections(r: dict) -> list[tuple[str, list[str]]]:
    h, m, s = r["header"], r["model"], r["stages"]
    out = [("Machine", _table([("", ""), ("CPU", f"{h['cpu']}; {h['cpus']} logical CPUs"),
                               ("flags", " ".join(h["flags"]) or "-"), ("kernels", h["kernels"]),
                               ("threads", f"{h['threads']} ({h.get('threads_from', '--threads')})"),
                               ("GPU", h["gpu"] or "none (GPU figures: unmeasured here)"),
                               ("versions", ", ".join(f"{k} {v}" for k, v in h["versions"].items())),
                               ("run", f"{h['date']}: `{h['command']}`")]))]
    out.append(("Targets", _table([("figure", "measured", "target", ""),
                                    *((k, t["value"], t["target"], _met(t)) for k, t in r["targets"].items())])))
    ms = m["ms"]
    out.append((f"Per frame on the clip ({m['frames']} frames of {r['clip']} at 10 fps; {m['path']}; reuse ratio "
                f"{m['reuse_ratio_mean']})",
                _table([("contender", "ms per frame (median)", "peer / this"),
                        *((name, ms[name], round(ms["peer"] / ms[name], 2)) for name in ms)])
                + [""] + _table([("accuracy vs the fp32 reference", "logit rel. err. mean", "max", "bins agreement"),
                                 *((name, a["logit_rel_err_mean"], a["logit_rel_err_max"], a["bins_agreement"])
                                   for name, a in m["accuracy_vs_fp32_reference"].items())])
                + [""] + _table([("floor of a reuse frame", "refreshed tokens", "GFLOP", "matrix GFLOP/s", "floor ms",
                                  "bound", "contender", "ratio to floor", "peer / floor"),
                                 *((key.replace("_", " "), f["refreshed"], f["gflop"], f["matrix_gflops"],
                                    f["floor_ms"], f["bound"], f["contender"],
                                    f["ratio_to_floor"], f["peer_over_floor"])
                                   for key, f in m.items() if key in ("floor", "int8_floor"))])))
    out.append(("Stages by backend (ms, median of interleaved rounds)",
                _table([("backend: stage", "ms"), *s["ms"].items()])))
    out.append(("Stages against their floor",
                _table([("backend: stage", "GFLOP", "MB read", "matrix GFLOP/s", "GB/s", "floor ms", "bound",
                         "stage ms", "ratio to floor"),
                        *((k, f["gflop"], round(f["weight_mb"] + f["kv_mb"], 2), f["matrix_gflops"], f["bandwidth_gbs"],
                           f["floor_ms"], f["bound"], f["stage_ms"], f["ratio_to_floor"])
                          for k, f in s["floor"].items())])
                + ["", "How it is counted: " + " ".join((floor.__doc__ or "").split())]))
    if r.get("node"):
        rep = r["node"]["report"]
        out.append((f"Node: {rep['drive']} replayed at 1x ({rep['backend']}, {rep['recipe']})",
                    _table([("figure", "value"), ("frames sent / processed", f"{rep['frames_sent']} / "
                                                                            f"{rep['frames_processed']}"),
                            ("frame-to-action ms p50 / p99 / max", " / ".join(
                                str(rep["latency_ms"][k]) for k in ("p50", "p99", "max"))),
                            ("control jitter ms p50 / p99 / max", " / ".join(
                                str(rep["control_jitter_ms"][k]) for k in ("p50", "p99", "max"))),
                            ("deadline misses", rep["deadline_misses"]), ("startup s", rep.get("startup_s")),
                            *((f"node's own {stage} ms per chunk p50 / p99 / max", " / ".join(
                                str(v[k]) for k in ("p50", "p99", "max")))
                              for stage, v in (rep.get("stage_ms") or {}).items()),
                            ("report", r["node"]["report_json"])])))
    bench = r.get("benchmarks") or {}
    if "engines" in bench:
        from vla_node.bench.engines import table

        out.append(("bench engines", ["```", table(bench["engines"]), "```"]))
    if "reuse" in bench:
        rows = [("clip: setting", "reuse ratio", "vision update speedup", "logit rel. err.", "bins agreement")]
        for clip, settings in bench["reuse"].items():
            for key, f in settings.items():
                rows.append((f"{clip}: {key}", *(_short(f.get(k)) for k in ("reuse_ratio_mean", "vision_update_speedup",
                                                                           "logit_rel_err", "top1_agreement"))))
        out.append(("bench reuse", _table(rows)))
    if "cache" in bench:
        keys = ("action_tick_ms", "vision_update_ms", "vision_update_with_tick_ms", "text_update_ms",
                "reference_step_ms", "hf_generate_ms")
        out.append(("bench cache", _table([("figure", "ms"), *((k, bench["cache"].get(k)) for k in keys)])))
    return out


def markdown(r: dict) -> str:
    lines = [f"# vla-node bench all: {r['preset']}, {r['header']['cpu']}", ""]
    for title, body in _sections(r):
        lines += [f"## {title}", "", *body, ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- html

def bars_svg(title: str, rows: Sequence[tuple[str, float]], unit: str, line_at: float | None = None,
             line_label: str = "") -> str:
    """Horizontal bars, one per (label, value), with an optional vertical reference line."""
    width, left, bar, gap, top = 760, 300, 18, 6, 30
    height = top + len(rows) * (bar + gap) + 30
    values = [v for _, v in rows if v is not None]
    scale_max = max([*values, line_at or 0.0, 1e-9]) * 1.1
    x = lambda v: left + (width - left - 20) * v / scale_max  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
             f'<title>{html.escape(title)}</title>',
             f'<text x="10" y="18" font-weight="bold">{html.escape(title)}</text>']
    for i, (label, value) in enumerate(rows):
        y = top + i * (bar + gap)
        parts.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end" font-size="12">{html.escape(label)}</text>')
        if value is None:
            parts.append(f'<text x="{left + 4}" y="{y + 13}" font-size="12">not measured</text>')
            continue
        colour = BAR_COLOURS[i % len(BAR_COLOURS)]
        parts.append(f'<rect x="{left}" y="{y}" width="{x(value) - left:.1f}" height="{bar}" fill="{colour}"/>')
        parts.append(f'<text x="{x(value) + 4:.1f}" y="{y + 13}" font-size="12">{value:g} {html.escape(unit)}</text>')
    if line_at is not None:
        parts.append(f'<line x1="{x(line_at):.1f}" x2="{x(line_at):.1f}" y1="{top - 4}" y2="{height - 24}" '
                     'stroke="#000" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{x(line_at):.1f}" y="{height - 10}" text-anchor="middle" font-size="12">'
                     f'{html.escape(line_label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def histogram_rows(values_ms: Sequence[float], bins: int = 12) -> list[tuple[str, float]]:
    """(bin label, count) rows of the latencies."""
    if not values_ms:
        return []
    counts, edges = np.histogram(np.asarray(values_ms, np.float64), bins=bins)
    return [(f"{lo:.0f}-{hi:.0f} ms", float(n)) for n, lo, hi in zip(counts, edges[:-1], edges[1:])]


def render_html(r: dict) -> str:
    """A self-contained page: the plots, then every table of bench.md."""
    s, m = r["stages"], r["model"]
    plots = [bars_svg("Per-stage time by backend", list(s["ms"].items()), "ms"),
             bars_svg(f"Per frame on the clip ({m['path']})", list(m["ms"].items()), "ms"),
             bars_svg("Ratio to floor", [(k, f["ratio_to_floor"]) for k, f in s["floor"].items()], "x",
                      line_at=2.0, line_label="target 2x")]
    if r.get("node") and r["node"].get("latency_ms"):
        plots.append(bars_svg("Node run: frame-to-action latency distribution (frames)",
                              histogram_rows(r["node"]["latency_ms"]), "frames"))
    body = []
    for title, lines in _sections(r):
        body.append(f"<h2>{html.escape(title)}</h2>")
        body.append(_md_block_html(lines))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>vla-node bench all</title><style>"
            "body{font-family:sans-serif;margin:20px}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:2px 6px;font-size:13px}pre{background:#f6f6f6;padding:6px}</style></head><body>"
            f"<h1>vla-node bench all: {html.escape(str(r['preset']))}, {html.escape(r['header']['cpu'])}</h1>"
            + "".join(f"<div>{p}</div>" for p in plots) + "".join(body) + "</body></html>\n")


def _md_block_html(lines: list[str]) -> str:
    """bench.md's lines of one section as HTML: tables as tables, code blocks as <pre>, the rest as paragraphs."""
    out, in_code, rows = [], False, []

    def flush_table() -> None:
        if rows:
            head, *rest = rows
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                                 for row in rest) + "</table>")
            rows.clear()

    for line in lines:
        if line.startswith("```"):
            flush_table()
            out.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
        elif in_code:
            out.append(html.escape(line) + "\n")
        elif line.startswith("|"):
            if not line.startswith("|---"):
                rows.append([c.strip() for c in line.strip("|").split(" | ")])
        else:
            flush_table()
            if line:
                out.append(f"<p>{html.escape(line)}</p>")
    flush_table()
    return "".join(out)
