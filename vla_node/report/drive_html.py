"""The closed-loop drive's page: one self-contained HTML file (inline SVG) from drive.json's content.

Plots: the bird's-eye view (the road's lines and the car's trace in the world plane, one metre the same on both
axes, departures and collisions marked), the trace along the road (lateral offset against distance, the lane lines
straight: what a lane departure looks like), speed against its goal, and the actions over time. Then the figures,
the instructions with their outcome, and the latency figures (the full latency report is report.html beside it).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from vla_node.report.html import (
    HEIGHT,
    LINE_COLOUR,
    MARGIN_BOTTOM,
    MARGIN_LEFT,
    MARGIN_RIGHT,
    MARGIN_TOP,
    STYLE,
    WIDTH,
    _axes,
    _cell,
    _e,
    _Frame,
    _legend,
    _line_points,
    _no_data,
    _numeric_ticks,
    _svg_open,
    _time_frame,
    nice_ticks,
)

EVENT_COLOURS = {"departure": "#f2a900", "collision": "#c62828"}
ROAD_COLOUR, LANE_COLOUR = "#555", "#999"
SUMMARY_KEYS = ("seconds", "distance_m", "lateral_error_mean_m", "lateral_error_max_m", "lane_departures",
                "departures_at_speed", "seconds_out_of_lane", "collisions", "speed_error_mean_mps",
                "instruction_success", "left_road", "final_speed_mps", "status_counts", "sim_late_ticks")
PLOT_IDS = ("plot-birds-eye", "plot-along-road", "plot-speed", "plot-actions")


def birds_eye_svg(drive: Mapping[str, Any]) -> str:
    """World plane, equal scale: road lines (edges solid, lane lines dashed), the trace, events."""
    parts = _svg_open(PLOT_IDS[0], "Bird's-eye view (world plane, metres)")
    trace, geometry = drive["trace"], drive["geometry"]
    if not trace["x"]:
        return _no_data(parts, "no trace")
    xs = np.concatenate([np.asarray(trace["x"])] + [np.asarray(line["x"]) for line in geometry["lines"]])
    ys = np.concatenate([np.asarray(trace["y"])] + [np.asarray(line["y"]) for line in geometry["lines"]])
    x_lo, x_hi, y_lo, y_hi = float(xs.min()), float(xs.max()), float(ys.min()), float(ys.max())
    plot_w, plot_h = WIDTH - MARGIN_LEFT - MARGIN_RIGHT, HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    scale = min(plot_w / max(x_hi - x_lo, 1.0), plot_h / max(y_hi - y_lo, 1.0))  # px per metre, both axes
    cx, cy = (x_lo + x_hi) / 2, (y_lo + y_hi) / 2
    frame = _Frame(cx - plot_w / 2 / scale, cx + plot_w / 2 / scale, cy - plot_h / 2 / scale, cy + plot_h / 2 / scale)
    _, _, xt, xd = nice_ticks(frame.x_lo, frame.x_hi)
    _, _, yt, yd = nice_ticks(frame.y_lo, frame.y_hi)
    inside = lambda ticks, lo, hi: [t for t in ticks if lo <= t[0] <= hi]  # noqa: E731
    parts += _axes(frame, inside(_numeric_ticks(xt, xd), frame.x_lo, frame.x_hi),
                   inside(_numeric_ticks(yt, yd), frame.y_lo, frame.y_hi), "x (m, east)", "y (m, north)")
    for line in geometry["lines"]:
        dash = "" if line["solid"] else ' stroke-dasharray="4 4"'
        points = " ".join(f"{u:.1f},{v:.1f}" for u, v in zip(frame.px(line["x"]), frame.py(line["y"])))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{ROAD_COLOUR if line["solid"] else LANE_COLOUR}"'
                     f' stroke-width="1"{dash}/>')
    points = _line_points_ordered(frame, np.asarray(trace["x"]), np.asarray(trace["y"]))
    parts.append(f'<polyline points="{points}" fill="none" stroke="{LINE_COLOUR}" stroke-width="1.5"/>')
    parts += _events(frame, drive["events"], "x", "y")
    parts += _legend([("trace", LINE_COLOUR), ("departure", EVENT_COLOURS["departure"]),
                      ("collision", EVENT_COLOURS["collision"])])
    parts.append("</svg>")
    return "\n".join(parts)


def _line_points_ordered(frame: _Frame, x: np.ndarray, y: np.ndarray) -> str:
    """A path in the order driven (a road may bend back in x: no sorting)."""
    return " ".join(f"{u:.1f},{v:.1f}" for u, v in zip(frame.px(x), frame.py(y)))


def _events(frame: _Frame, events, x_key: str, y_key: str) -> list[str]:
    parts = []
    for event in events:
        colour = EVENT_COLOURS.get(event["what"], "#000")
        parts.append(f'<circle cx="{float(frame.px(event[x_key])):.1f}" cy="{float(frame.py(event[y_key])):.1f}" '
                     f'r="5" fill="none" stroke="{colour}" stroke-width="2"><title>{_e(event["what"])} at '
                     f'{event["t"]} s</title></circle>')
    return parts


def along_road_svg(drive: Mapping[str, Any]) -> str:
    """Lateral offset d against distance along the road, the lane lines straight."""
    parts = _svg_open(PLOT_IDS[1], "Along the road (lateral offset, left positive, against distance)")
    trace, geometry = drive["trace"], drive["geometry"]
    if not trace["s"]:
        return _no_data(parts, "no trace")
    s = np.asarray(trace["s"]) - trace["s"][0]
    d = np.asarray(trace["d"])
    line_d = [line["d"] for line in geometry["lines"]]
    frame, x_ticks, y_ticks = _time_frame(float(s.max()) if s.size else 1.0, min(min(line_d), float(d.min())) - 0.5,
                                          max(max(line_d), float(d.max())) + 0.5)
    parts += _axes(frame, x_ticks, y_ticks, "distance along the road (m)", "lateral offset d (m)")
    for line in geometry["lines"]:
        y = float(frame.py(line["d"]))
        dash = "" if line["solid"] else ' stroke-dasharray="6 4"'
        parts.append(f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{WIDTH - MARGIN_RIGHT}" y2="{y:.1f}" '
                     f'stroke="{ROAD_COLOUR if line["solid"] else LANE_COLOUR}"{dash}/>')
    parts.append(f'<polyline points="{_line_points(frame, s, d)}" fill="none" stroke="{LINE_COLOUR}" '
                 'stroke-width="1.5"/>')
    parts.append("</svg>")
    return "\n".join(parts)


def _series_svg(plot_id: str, title: str, t: np.ndarray, series: list[tuple[str, np.ndarray, str]],
                y_label: str) -> str:
    parts = _svg_open(plot_id, title)
    if t.size == 0:
        return _no_data(parts, "no trace")
    values = np.concatenate([v for _, v, _ in series])
    frame, x_ticks, y_ticks = _time_frame(float(t.max()), float(values.min()), float(values.max()))
    parts += _axes(frame, x_ticks, y_ticks, "time (s)", y_label)
    for _, v, colour in series:
        parts.append(f'<polyline points="{_line_points(frame, t, v)}" fill="none" stroke="{colour}" '
                     'stroke-width="1.3"/>')
    parts += _legend([(name, colour) for name, _, colour in series])
    parts.append("</svg>")
    return "\n".join(parts)


def _goal_speed(drive: Mapping[str, Any], t: np.ndarray) -> np.ndarray:
    goal = np.full(t.shape, np.nan)
    for row in drive["instructions"]:
        goal[(t >= row["at_s"]) & (t <= row["until_s"])] = row["speed_mps"]
    return goal


def _table(rows: list[Mapping[str, Any]]) -> str:
    if not rows:
        return "<p>None.</p>"
    keys = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{_e(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f'<td class="num">{_e(_cell(row.get(k)))}</td>' for k in keys) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_drive_html(drive: Mapping[str, Any]) -> str:
    """The page; every string from drive.json is escaped."""
    trace = drive["trace"]
    t = np.asarray(trace["t"], dtype=np.float64)
    speed = np.asarray(trace["speed"], dtype=np.float64)
    goal = _goal_speed(drive, t)
    summary = "".join(f'<tr><th>{_e(k)}</th><td class="num">{_e(_cell(drive.get(k)))}</td></tr>'
                      for k in SUMMARY_KEYS)
    latency = "".join(f'<tr><th>{_e(k)}</th><td class="num">{_e(_cell(v))}</td></tr>'
                      for k, v in drive["latency"].items())
    sections = [
        ("Bird's-eye view", birds_eye_svg(drive)),
        ("Along the road", along_road_svg(drive)),
        ("Speed", _series_svg(PLOT_IDS[2], "Speed and the goal speed", t,
                              [("speed", speed, LINE_COLOUR),
                               ("goal", np.where(np.isnan(goal), speed, goal), "#888")], "m/s")),
        ("Actions", _series_svg(PLOT_IDS[3], "Actions applied (steer, accel in [-1, 1])", t,
                                [("steer", np.asarray(trace["steer"]), LINE_COLOUR),
                                 ("accel", np.asarray(trace["accel"]), "#2e7d32")], "action")),
        ("Instructions", _table(drive["instructions"])),
        ("Events", _table(drive["events"])),
        ("Latency (report.html has the full latency report)", f'<table class="summary">{latency}</table>'),
    ]
    body = "\n".join(f"<h2>{_e(heading)}</h2>\n{content}" for heading, content in sections)
    title = f"vla-node drive: {drive['checkpoint']} on road {drive['sim']['seed']}"
    setup = ", ".join(f"{k} {_cell(v)}" for k, v in drive["sim"].items())
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_e(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n<h1>{_e(title)}</h1>\n"
            f"<p>launch {_e(drive['launch'])}; {_e(setup)}</p>\n"
            f'<table class="summary">{summary}</table>\n{body}\n</body>\n</html>\n')
