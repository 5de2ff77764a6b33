"""The human report: one self-contained HTML page (no external references) with plots drawn as inline SVG.

Plots: latency over time against the deadline, latency histogram, status bands and degrade level over time,
vision reuse ratio over time, KV bytes per partition. Long runs are reduced per pixel column (min/max, or the
worst status/level), so spikes stay visible and the page stays small.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

WIDTH, HEIGHT = 820, 270
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 42, 48
STATUS_COLOURS = {"fresh": "#2e7d32", "chunk": "#f2a900", "fallback": "#c62828"}
LINE_COLOUR, LATE_COLOUR, DEADLINE_COLOUR, GRID_COLOUR, TEXT_COLOUR = "#1565c0", "#c62828", "#c62828", "#e0e0e0", "#222"
PLOT_IDS = ("plot-latency-time", "plot-latency-hist", "plot-level-status", "plot-reuse", "plot-kv-bytes")


@dataclass(frozen=True)
class PlotSeries:
    """Everything the plots draw; times are seconds since the run's earliest stamp, actions in seq order."""

    latency_t_s: np.ndarray  # (n_latencies,) capture time of each processed frame a fresh action named
    latency_ms: np.ndarray  # (n_latencies,)
    dropped_t_s: np.ndarray  # (n_dropped,) capture time of frames the node did not process
    action_t_s: np.ndarray  # (n_actions,) node stamp of each action
    action_status: np.ndarray  # (n_actions,) index into status_names (higher is worse)
    action_level: np.ndarray  # (n_actions,) index into level_names (higher is more degraded)
    level_names: tuple[str, ...]
    status_names: tuple[str, ...]
    reuse_t_s: np.ndarray  # (n_reuse,) node stamp of fresh actions that carry a reuse ratio
    reuse_ratio: np.ndarray  # (n_reuse,)
    stage_ms: Mapping[str, np.ndarray]  # stage name -> (n,) timing_ms values over all actions


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def nice_ticks(lo: float, hi: float, target: int = 6) -> tuple[float, float, np.ndarray, int]:
    """Axis range widened to round steps (1, 2, 5 x 10^k), the ticks, and decimals to print them with."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi <= lo:
        lo, hi = (lo - 0.5, hi + 0.5) if lo != 0 else (0.0, 1.0)
    raw = (hi - lo) / target
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw * 0.999)
    lo_n, hi_n = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    ticks = lo_n + step * np.arange(round((hi_n - lo_n) / step) + 1)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return lo_n, hi_n, ticks, decimals


@dataclass(frozen=True)
class _Frame:
    """Data range -> pixel mapping of one plot area."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    top: int = MARGIN_TOP

    @property
    def plot_w(self) -> int:
        return WIDTH - MARGIN_LEFT - MARGIN_RIGHT

    @property
    def plot_h(self) -> int:
        return HEIGHT - self.top - MARGIN_BOTTOM

    def px(self, x: Any) -> Any:
        return MARGIN_LEFT + (np.asarray(x, dtype=np.float64) - self.x_lo) / (self.x_hi - self.x_lo) * self.plot_w

    def py(self, y: Any) -> Any:
        fraction = (np.asarray(y, dtype=np.float64) - self.y_lo) / (self.y_hi - self.y_lo)
        return self.top + self.plot_h - fraction * self.plot_h


def _svg_open(plot_id: str, title: str) -> list[str]:
    return [f'<svg id="{_e(plot_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{_e(title)}" '
            f'font-family="sans-serif" font-size="11" fill="{TEXT_COLOUR}">',
            f"<title>{_e(title)}</title>",
            f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
            f'<text x="{WIDTH / 2:.0f}" y="18" text-anchor="middle" font-size="13" font-weight="bold">'
            f"{_e(title)}</text>"]


def _axes(frame: _Frame, x_ticks: Sequence[tuple[float, str]], y_ticks: Sequence[tuple[float, str]],
          x_label: str, y_label: str) -> list[str]:
    """Grid, axis lines, tick marks and labels, axis titles."""
    left, right = MARGIN_LEFT, MARGIN_LEFT + frame.plot_w
    top, bottom = frame.top, frame.top + frame.plot_h
    parts = []
    for value, label in y_ticks:
        y = float(frame.py(value))
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="{GRID_COLOUR}"/>')
        parts.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#555"/>')
        parts.append(f'<text x="{left - 7}" y="{y + 4:.1f}" text-anchor="end">{_e(label)}</text>')
    for value, label in x_ticks:
        x = float(frame.px(value))
        parts.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#555"/>')
        parts.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_e(label)}</text>')
    parts.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#555"/>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#555"/>')
    parts.append(f'<text x="{(left + right) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">{_e(x_label)}</text>')
    mid = (top + bottom) / 2
    parts.append(f'<text x="14" y="{mid:.0f}" text-anchor="middle" transform="rotate(-90 14 {mid:.0f})">'
                 f"{_e(y_label)}</text>")
    return parts


def _numeric_ticks(ticks: np.ndarray, decimals: int) -> list[tuple[float, str]]:
    return [(float(t), f"{t:.{decimals}f}") for t in ticks]


def _no_data(parts: list[str], message: str) -> str:
    parts.append(f'<text x="{WIDTH / 2:.0f}" y="{HEIGHT / 2:.0f}" text-anchor="middle" fill="#888" '
                 f'font-size="13">{_e(message)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _legend(entries: Sequence[tuple[str, str]], y: int = 31) -> list[str]:
    """Colour swatches at the top right."""
    parts, x = [], WIDTH - MARGIN_RIGHT
    for label, colour in reversed(entries):
        x -= 8 + 7 * len(label)
        parts.append(f'<text x="{x + 14}" y="{y + 4}">{_e(label)}</text>')
        parts.append(f'<rect x="{x}" y="{y - 5}" width="10" height="10" fill="{colour}"/>')
        x -= 10
    return parts


def _boxed_label(x: float, y: float, text: str, colour: str, anchor: str) -> list[str]:
    """Text on a white box (about 6.5 px per character at font-size 11), readable over dense data."""
    width = 6.5 * len(text) + 6
    left = x - width + 3 if anchor == "end" else x - 3
    return [f'<rect x="{left:.1f}" y="{y - 11:.1f}" width="{width:.1f}" height="15" fill="#fff" fill-opacity="0.85"/>',
            f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{colour}">{_e(text)}</text>']


def _columns(px_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pixel column of each run of samples, index where each run starts) for x sorted ascending."""
    cols = np.floor(px_x).astype(np.int64)  # (n,)
    starts = np.flatnonzero(np.r_[True, cols[1:] != cols[:-1]])  # (n_columns,)
    return cols[starts], starts


def _line_points(frame: _Frame, x: np.ndarray, y: np.ndarray) -> str:
    """Polyline points; above two samples per pixel column each column keeps its min and max."""
    order = np.argsort(x, kind="stable")
    px, py = frame.px(x[order]), frame.py(y[order])
    if px.size > 2 * frame.plot_w:
        cols, starts = _columns(px)
        lo, hi = np.minimum.reduceat(py, starts), np.maximum.reduceat(py, starts)
        first, last = py[starts], py[np.r_[starts[1:], py.size] - 1]
        rising = last <= first  # pixel y grows downwards
        a, b = np.where(rising, hi, lo), np.where(rising, lo, hi)
        px = np.repeat(cols.astype(np.float64), 2)
        py = np.stack([a, b], axis=1).reshape(-1)  # (n_columns, 2) -> (2 * n_columns,)
    return " ".join(f"{u:.1f},{v:.1f}" for u, v in zip(px, py))


def _markers(frame: _Frame, x: np.ndarray, y: np.ndarray, colour: str, radius: float) -> list[str]:
    """Circles, one per distinct pixel (so thousands of samples do not bloat the page)."""
    px, py = np.round(frame.px(x)).astype(np.int64), np.round(frame.py(y)).astype(np.int64)
    pixels = np.unique(np.stack([px, py], axis=1), axis=0) if px.size else np.zeros((0, 2), np.int64)
    return [f'<circle cx="{u}" cy="{v}" r="{radius}" fill="{colour}"/>' for u, v in pixels]


def _time_frame(t_max: float, y_lo: float, y_hi: float, top: int = MARGIN_TOP) -> tuple[_Frame, list, list]:
    x_lo, x_hi, xt, xd = nice_ticks(0.0, t_max)
    y_lo_n, y_hi_n, yt, yd = nice_ticks(y_lo, y_hi)
    frame = _Frame(x_lo, x_hi, y_lo_n, y_hi_n, top)
    return frame, _numeric_ticks(xt, xd), _numeric_ticks(yt, yd)


def latency_over_time_svg(s: PlotSeries, deadline_ms: float) -> str:
    title = "Latency over time (capture -> first fresh action)"
    parts = _svg_open(PLOT_IDS[0], title)
    if s.latency_ms.size == 0 and s.dropped_t_s.size == 0:
        return _no_data(parts, "no processed frame was named by a fresh action")
    t_max = max(float(np.max(s.latency_t_s, initial=0.0)), float(np.max(s.dropped_t_s, initial=0.0)))
    frame, xt, yt = _time_frame(t_max, 0.0, max(float(np.max(s.latency_ms, initial=0.0)), deadline_ms) * 1.05)
    parts += _axes(frame, xt, yt, "time since start (s)", "latency (ms)")
    if s.dropped_t_s.size:
        bottom = frame.top + frame.plot_h
        for col in np.unique(np.round(frame.px(s.dropped_t_s)).astype(np.int64)):
            parts.append(f'<line x1="{col}" y1="{bottom - 8}" x2="{col}" y2="{bottom}" stroke="#9e9e9e"/>')
    if s.latency_ms.size:
        parts.append(f'<polyline points="{_line_points(frame, s.latency_t_s, s.latency_ms)}" fill="none" '
                     f'stroke="{LINE_COLOUR}" stroke-width="1.2"/>')
        late = s.latency_ms > deadline_ms
        if s.latency_ms.size <= 600:
            parts += _markers(frame, s.latency_t_s[~late], s.latency_ms[~late], LINE_COLOUR, 2)
        parts += _markers(frame, s.latency_t_s[late], s.latency_ms[late], LATE_COLOUR, 2.5)
    y = float(frame.py(deadline_ms))
    parts.append(f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{MARGIN_LEFT + frame.plot_w}" y2="{y:.1f}" '
                 f'stroke="{DEADLINE_COLOUR}" stroke-width="1.5" stroke-dasharray="6 4"/>')
    parts += _boxed_label(MARGIN_LEFT + frame.plot_w - 4, y - 4, f"deadline {deadline_ms:g} ms", DEADLINE_COLOUR, "end")
    parts += _legend([("latency", LINE_COLOUR), ("over deadline", LATE_COLOUR), ("dropped frame", "#9e9e9e")])
    parts.append("</svg>")
    return "\n".join(parts)


def latency_histogram_svg(s: PlotSeries, deadline_ms: float) -> str:
    title = "Latency histogram"
    parts = _svg_open(PLOT_IDS[1], title)
    if s.latency_ms.size == 0:
        return _no_data(parts, "no latencies to histogram")
    x_lo, x_hi, xt, xd = nice_ticks(0.0, max(float(np.max(s.latency_ms)), deadline_ms) * 1.02)
    _, _, bin_ticks, _ = nice_ticks(x_lo, x_hi, target=40)
    counts, edges = np.histogram(s.latency_ms, bins=bin_ticks)
    y_lo, y_hi, yt, _ = nice_ticks(0.0, max(float(counts.max()), 5.0))
    frame = _Frame(x_lo, x_hi, y_lo, y_hi)
    parts += _axes(frame, _numeric_ticks(xt, xd), [(float(t), f"{t:.0f}") for t in yt if t == round(t)],
                   "latency (ms)", "frames")
    base = frame.top + frame.plot_h
    for count, left, right in zip(counts, edges[:-1], edges[1:]):
        if count == 0:
            continue
        x0, x1, y = float(frame.px(left)), float(frame.px(right)), float(frame.py(count))
        colour = LATE_COLOUR if left >= deadline_ms else LINE_COLOUR
        parts.append(f'<rect x="{x0 + 0.5:.1f}" y="{min(y, base - 1.0):.1f}" width="{max(x1 - x0 - 1, 1):.1f}" '
                     f'height="{max(base - y, 1.0):.1f}" fill="{colour}">'
                     f"<title>{left:g}-{right:g} ms: {count}</title></rect>")
    x = float(frame.px(deadline_ms))
    parts.append(f'<line x1="{x:.1f}" y1="{frame.top}" x2="{x:.1f}" y2="{base}" stroke="{DEADLINE_COLOUR}" '
                 f'stroke-width="1.5" stroke-dasharray="6 4"/>')
    late = int(np.sum(s.latency_ms > deadline_ms))
    label = f"deadline {deadline_ms:g} ms: {late} of {s.latency_ms.size} frames over"
    parts.append(f'<text x="{WIDTH - MARGIN_RIGHT}" y="31" text-anchor="end" fill="{DEADLINE_COLOUR}">'
                 f"- - {_e(label)}</text>")
    parts.append("</svg>")
    return "\n".join(parts)


def _status_band(s: PlotSeries, order: np.ndarray, cols: np.ndarray, starts: np.ndarray, top: int, height: int,
                 right_edge: int) -> list[str]:
    """Per pixel column, the share of each status stacked in `height` pixels; any status present gets at least
    one pixel, so a single fallback among many ticks stays visible. A column holds until the next one."""
    n_status = len(s.status_names)
    one_hot = (s.action_status[order][:, None] == np.arange(n_status)[None, :]).astype(np.int64)  # (n, n_status)
    counts = np.add.reduceat(one_hot, starts, axis=0)  # (n_columns, n_status)
    shares = counts / counts.sum(axis=1, keepdims=True) * height
    pixels = np.where(counts > 0, np.maximum(np.round(shares), 1), 0).astype(np.int64)  # (n_columns, n_status)
    rows = np.arange(pixels.shape[0])
    pixels[rows, np.argmax(counts, axis=1)] += height - pixels.sum(axis=1)
    change = np.flatnonzero(np.r_[True, np.any(pixels[1:] != pixels[:-1], axis=1)])  # runs of equal columns
    ends = np.r_[cols[change[1:]], min(int(cols[-1]) + 2, right_edge)]
    parts = []
    for start, end, column in zip(cols[change], ends, pixels[change]):
        y = top
        for status, h in enumerate(column):
            if h:
                colour = STATUS_COLOURS.get(s.status_names[status], "#757575")
                parts.append(f'<rect x="{start}" y="{y}" width="{max(int(end) - int(start), 1)}" height="{h}" '
                             f'fill="{colour}"/>')
                y += int(h)
    return parts


def level_status_svg(s: PlotSeries) -> str:
    """Status of every control tick as a coloured band (share per pixel column) over the degrade level
    (worst per pixel column)."""
    title = "Action status and degrade level over time"
    parts = _svg_open(PLOT_IDS[2], title)
    if s.action_t_s.size == 0:
        return _no_data(parts, "no actions received")
    band_top, band_h = MARGIN_TOP + 4, 16
    n_levels = max(len(s.level_names), 1)
    x_lo, x_hi, xt, xd = nice_ticks(0.0, float(np.max(s.action_t_s)))
    frame = _Frame(x_lo, x_hi, -0.5, n_levels - 0.5, top=band_top + band_h + 8)
    parts += _axes(frame, _numeric_ticks(xt, xd), list(enumerate(s.level_names)), "time since start (s)",
                   "degrade level")
    order = np.argsort(s.action_t_s, kind="stable")
    px = frame.px(s.action_t_s[order])
    cols, starts = _columns(px)
    worst_level = np.maximum.reduceat(s.action_level[order], starts)  # (n_columns,)
    parts += _status_band(s, order, cols, starts, band_top, band_h, MARGIN_LEFT + frame.plot_w)
    parts.append(f'<text x="{MARGIN_LEFT - 7}" y="{band_top + 12}" text-anchor="end">status</text>')
    end = min(float(cols[-1]) + 2, MARGIN_LEFT + frame.plot_w)  # the last level holds as long as its status band
    step_x = np.r_[np.repeat(cols.astype(np.float64), 2)[1:], end]  # (2 * n_columns,) horizontal then vertical
    step_y = np.repeat(frame.py(worst_level), 2)
    points = " ".join(f"{u:.1f},{v:.1f}" for u, v in zip(step_x, step_y))
    parts.append(f'<polyline points="{points}" fill="none" stroke="{LINE_COLOUR}" stroke-width="1.5"/>')
    parts += _legend([(name, STATUS_COLOURS.get(name, "#757575")) for name in s.status_names])
    parts.append("</svg>")
    return "\n".join(parts)


def reuse_svg(s: PlotSeries) -> str:
    title = "Vision reuse ratio over time (fresh actions)"
    parts = _svg_open(PLOT_IDS[3], title)
    if s.reuse_ratio.size == 0:
        return _no_data(parts, "no fresh action carried a reuse ratio")
    frame, xt, yt = _time_frame(float(np.max(s.reuse_t_s)), 0.0, 1.0)
    parts += _axes(frame, xt, yt, "time since start (s)", "reused tokens / all tokens")
    parts.append(f'<polyline points="{_line_points(frame, s.reuse_t_s, s.reuse_ratio)}" fill="none" '
                 f'stroke="{LINE_COLOUR}" stroke-width="1.2"/>')
    if s.reuse_ratio.size <= 600:
        parts += _markers(frame, s.reuse_t_s, s.reuse_ratio, LINE_COLOUR, 2)
    parts.append("</svg>")
    return "\n".join(parts)


def _byte_unit(n: float) -> tuple[str, int]:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return unit, size
    return "B", 1


def _human_bytes(n: int) -> str:
    unit, size = _byte_unit(n)
    return f"{n} B" if size == 1 else f"{n / size:.1f} {unit}"


def kv_bytes_svg(kv_bytes: Mapping[str, int]) -> str:
    title = "KV cache bytes per partition"
    parts = _svg_open(PLOT_IDS[4], title)
    names = list(kv_bytes)
    unit, size = _byte_unit(max(kv_bytes.values(), default=0))
    values = np.array([kv_bytes[n] / size for n in names], dtype=np.float64)  # (n_partitions,)
    y_lo, y_hi, yt, yd = nice_ticks(0.0, max(float(values.max(initial=0.0)), 1e-9) * 1.1)
    frame = _Frame(0.0, float(len(names)), y_lo, y_hi if values.any() else 1.0)
    if not values.any():
        yt, yd = np.linspace(0.0, 1.0, 6), 1
    parts += _axes(frame, [(i + 0.5, n) for i, n in enumerate(names)], _numeric_ticks(yt, yd), "partition",
                   f"bytes ({unit})")
    base = frame.top + frame.plot_h
    for i, (name, value) in enumerate(zip(names, values)):
        x0, x1, y = float(frame.px(i + 0.2)), float(frame.px(i + 0.8)), float(frame.py(value))
        parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{x1 - x0:.1f}" height="{base - y:.1f}" '
                     f'fill="{LINE_COLOUR}"/>')
        parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y - 5:.1f}" text-anchor="middle">'
                     f"{_e(_human_bytes(int(kv_bytes[name])))}</text>")
    if not values.any():
        parts.append(f'<text x="{WIDTH / 2:.0f}" y="{frame.top + 20}" text-anchor="middle" fill="#888">'
                     "no KV sizes reported</text>")
    parts.append("</svg>")
    return "\n".join(parts)


def _cell(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _stage_table(stage_ms: Mapping[str, np.ndarray]) -> str:
    if not stage_ms:
        return "<p>No stage timings were reported.</p>"
    rows = ["<tr><th>stage</th><th>n</th><th>p50 ms</th><th>p99 ms</th><th>max ms</th></tr>"]
    for name, values in stage_ms.items():
        p50, p99 = np.percentile(values, [50, 99], method="linear")
        rows.append(f"<tr><td>{_e(name)}</td><td>{values.size}</td><td>{p50:.3f}</td><td>{p99:.3f}</td>"
                    f"<td>{np.max(values):.3f}</td></tr>")
    return '<table class="stages">' + "".join(rows) + "</table>"


STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 900px; }
h1 { font-size: 20px; } h2 { font-size: 15px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ddd; padding: 3px 10px; text-align: left; }
th { background: #f5f5f5; }
td.num { font-family: monospace; }
svg { display: block; border: 1px solid #eee; margin: 8px 0; }
"""


def render_html(report: Mapping[str, Any], s: PlotSeries) -> str:
    """The whole page as a string; every string from the report or the records is escaped."""
    deadline = float(report["deadline_ms"])
    summary = "".join(f'<tr><th>{_e(key)}</th><td class="num">{_e(_cell(value))}</td></tr>'
                      for key, value in report.items())
    sections = [
        ("Latency", latency_over_time_svg(s, deadline)),
        ("Latency distribution", latency_histogram_svg(s, deadline)),
        ("Status and degrade level", level_status_svg(s)),
        ("Vision-token reuse", reuse_svg(s)),
        ("KV cache memory", kv_bytes_svg(report["kv_bytes"])),
        ("Stage timings (timing_ms of all actions)", _stage_table(s.stage_ms)),
    ]
    body = "\n".join(f"<h2>{_e(heading)}</h2>\n{content}" for heading, content in sections)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>vla-node report: {_e(report['drive'])}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            f"<h1>vla-node latency report: {_e(report['drive'])}</h1>\n"
            f'<table class="summary">{summary}</table>\n{body}\n</body>\n</html>\n')
