"""Latency reports of a replayed drive: records in, report.json + report.html out, a terminal summary,
and a comparison of two reports for regression gates.

The replay tool builds one FrameRecord per frame sent and one ActionRecord per action message received,
plus a RunMeta, and calls build_report / write_report. All stamps are CLOCK_MONOTONIC nanoseconds of one
host, so frame capture stamps and action receive stamps compare directly.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from vla_node.report.continuity import chunk_continuity
from vla_node.report.html import PlotSeries, render_html
from vla_node.validate import ConfigError, did_you_mean, is_int, is_number

STATUSES = ("fresh", "chunk", "fallback")
KV_PARTITIONS = ("text", "vision", "action")

# The exact key set of report.json; nested tables have exact key sets too (degrade_levels is open: level -> count).
REPORT_KEYS = (
    "drive", "model", "backend", "recipe", "frames_sent", "frames_processed", "frames_dropped", "actions",
    "control_hz", "deadline_ms", "latency_ms", "control_jitter_ms", "deadline_misses", "status_counts",
    "degrade_levels", "vision_reuse_ratio", "kv_bytes",
)
NESTED_KEYS = {
    "latency_ms": ("p50", "p90", "p99", "max"),
    "control_jitter_ms": ("p50", "p99", "max"),
    "status_counts": STATUSES,
    "kv_bytes": KV_PARTITIONS,
}
STRING_KEYS = ("drive", "model", "backend", "recipe")
COUNT_KEYS = ("frames_sent", "frames_processed", "frames_dropped", "actions", "deadline_misses")
NUMBER_KEYS = ("control_hz", "deadline_ms")
NULLABLE_NUMBER_KEYS = ("vision_reuse_ratio",)
# keys a report may lack (written by later versions: an older report still loads and compares)
CONTINUITY_KEYS = ("chunk_boundaries", "chunk_boundary_jump", "chunk_step_within", "chunk_boundary_deviation")
OPTIONAL_KEYS = ("startup_s", "head", "denoising_steps_mean", *CONTINUITY_KEYS, "stage_ms")
OPTIONAL_STRING_KEYS = ("head",)  # a string or null; stage_ms an object (below); the other optional keys are
                                  # numbers or null
STAGE_FIGURES = ("p50", "p99", "max")  # stage_ms: stage -> these, over the frames the node decoded a chunk from


class ReportError(ValueError):
    """A report file is unreadable or has the wrong shape; the message is one line naming the file and the key."""


def _check(ok: bool, where: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{where} = {value!r}: expected {expected}")


@dataclass(frozen=True)
class FrameRecord:
    """One frame the replay sent. first_action_ns: receive time of the first `fresh` action whose frame_seq is
    this frame's seq (None if none named it); processed: the node ran inference on this frame."""

    seq: int
    stamp_ns: int
    sent_ns: int
    first_action_ns: int | None
    processed: bool

    def __post_init__(self) -> None:
        _check(is_int(self.seq), "FrameRecord.seq", self.seq, "an integer")
        _check(is_int(self.stamp_ns), "FrameRecord.stamp_ns", self.stamp_ns, "integer ns")
        _check(is_int(self.sent_ns), "FrameRecord.sent_ns", self.sent_ns, "integer ns")
        _check(self.first_action_ns is None or is_int(self.first_action_ns),
               "FrameRecord.first_action_ns", self.first_action_ns, "integer ns or None")
        _check(isinstance(self.processed, bool), "FrameRecord.processed", self.processed, "true or false")


@dataclass(frozen=True)
class ActionRecord:
    """One action message the replay received (fields of the v1 action message plus its receive time)."""

    recv_ns: int
    stamp_ns: int
    seq: int
    status: str
    level: int | str
    frame_seq: int | None
    frame_stamp_ns: int | None
    timing_ms: Mapping[str, float]
    tokens_refreshed: int | None
    reuse_ratio: float | None
    kv_bytes: Mapping[str, int] | None
    action: tuple[float, ...] | None = None  # the published action [D] (None: not kept)
    chunk: tuple[tuple[float, ...], ...] | None = None  # its chunk [H][D] (None: fallback, or not kept)
    step: int | None = None  # the chunk's step this tick played
    denoising_steps: int | None = None  # the flow head's Euler steps for the chunk

    def __post_init__(self) -> None:
        _check(self.step is None or is_int(self.step), "ActionRecord.step", self.step, "an integer or None")
        _check(self.denoising_steps is None or is_int(self.denoising_steps), "ActionRecord.denoising_steps",
               self.denoising_steps, "an integer or None")
        _check(is_int(self.recv_ns), "ActionRecord.recv_ns", self.recv_ns, "integer ns")
        _check(is_int(self.stamp_ns), "ActionRecord.stamp_ns", self.stamp_ns, "integer ns")
        _check(is_int(self.seq), "ActionRecord.seq", self.seq, "an integer")
        _check(self.status in STATUSES, "ActionRecord.status", self.status, f"one of {list(STATUSES)}")
        _check(is_int(self.level) or isinstance(self.level, str), "ActionRecord.level", self.level,
               "an integer or a level name")
        _check(self.frame_seq is None or is_int(self.frame_seq), "ActionRecord.frame_seq", self.frame_seq,
               "an integer or None")
        _check(self.frame_stamp_ns is None or is_int(self.frame_stamp_ns), "ActionRecord.frame_stamp_ns",
               self.frame_stamp_ns, "integer ns or None")
        _check(isinstance(self.timing_ms, Mapping)
               and all(isinstance(k, str) and is_number(v, finite=False) for k, v in self.timing_ms.items()),
               "ActionRecord.timing_ms", self.timing_ms, "a map of stage name -> milliseconds")
        _check(self.tokens_refreshed is None or is_int(self.tokens_refreshed), "ActionRecord.tokens_refreshed",
               self.tokens_refreshed, "an integer or None")
        _check(self.reuse_ratio is None or (is_number(self.reuse_ratio) and 0.0 <= self.reuse_ratio <= 1.0),
               "ActionRecord.reuse_ratio", self.reuse_ratio, "a number in [0, 1] or None")
        _check(self.kv_bytes is None or (isinstance(self.kv_bytes, Mapping)
                                         and all(is_int(v) and v >= 0 for v in self.kv_bytes.values())),
               "ActionRecord.kv_bytes", self.kv_bytes, "a map of partition -> bytes (integers >= 0) or None")


@dataclass(frozen=True)
class RunMeta:
    """What was replayed, through what, and the node's last health message (empty dict if none came)."""

    drive: str
    model: str
    backend: str
    control_hz: float
    deadline_ms: float
    health: Mapping[str, Any]
    recipe: str = "unknown"  # the backend's recipe (engines: fp32, int8-ort ...; torch: its linear weights)
    head: str | None = None  # the action head (bins | flow), from the node's health
    startup_s: float | None = None  # node launch -> its first fresh action (None: the node was already running)

    def __post_init__(self) -> None:
        for key in STRING_KEYS:
            value = getattr(self, key)
            _check(isinstance(value, str), f"RunMeta.{key}", value, "a string")
        for key in NUMBER_KEYS:
            value = getattr(self, key)
            _check(is_number(value) and value > 0, f"RunMeta.{key}", value,
                   "a finite number > 0")
        _check(isinstance(self.health, Mapping), "RunMeta.health", self.health, "a map (the last health message)")
        _check(self.startup_s is None or (is_number(self.startup_s) and self.startup_s > 0), "RunMeta.startup_s",
               self.startup_s, "None or a finite number of seconds > 0")


def _percentiles(values_ms: np.ndarray, names: Sequence[str]) -> dict[str, float | None]:
    """{'p50': ..., 'max': ...} of values in ms; every figure is None (JSON null) when there are no values."""
    if values_ms.size == 0:
        return {name: None for name in names}
    out: dict[str, float | None] = {}
    for name in names:
        if name == "max":
            value = float(np.max(values_ms))
        else:
            value = float(np.percentile(values_ms, float(name[1:]), method="linear"))
        out[name] = round(value, 3)
    return out


def stage_costs_ms(actions: Sequence[ActionRecord]) -> dict[str, dict[str, float | None]]:
    """The node's own time per stage (its actions' timing_ms: text, vision, action, total), once per chunk: the
    first action naming each frame_seq with a timing (a chunk's later steps repeat it; fallbacks have none)."""
    seen: set[int] = set()
    per_stage: dict[str, list[float]] = {}
    for action in actions:
        if action.frame_seq is None or action.frame_seq in seen or not action.timing_ms:
            continue
        seen.add(action.frame_seq)
        for stage, ms in action.timing_ms.items():
            if math.isfinite(ms):  # strict JSON: a figure is a number or null
                per_stage.setdefault(stage, []).append(ms)
    return {stage: _percentiles(np.asarray(values, dtype=np.float64), STAGE_FIGURES)
            for stage, values in per_stage.items()}


def frame_latencies_ns(frames: Sequence[FrameRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(capture stamps, latency) in ns of processed frames that a fresh action named, in capture order."""
    pairs = sorted((f.stamp_ns, f.first_action_ns - f.stamp_ns)
                   for f in frames if f.processed and f.first_action_ns is not None)
    stamps = np.array([p[0] for p in pairs], dtype=np.int64)  # (n_latencies,)
    latency = np.array([p[1] for p in pairs], dtype=np.int64)  # (n_latencies,)
    return stamps, latency


def control_spacing(actions: Sequence[ActionRecord], control_hz: float) -> tuple[np.ndarray, int]:
    """(|stamp spacing - expected spacing| in ns for consecutive actions, control ticks missed).

    Actions are taken in seq order; the expected spacing between two actions is (seq difference) x control period,
    so a skipped tick counts once as a missed tick and not again as jitter. Repeated seqs are ignored."""
    if len(actions) < 2:
        return np.zeros(0, dtype=np.float64), 0
    seq = np.array([a.seq for a in actions], dtype=np.int64)  # (n_actions,)
    stamp = np.array([a.stamp_ns for a in actions], dtype=np.int64)  # (n_actions,)
    order = np.argsort(seq, kind="stable")
    d_seq = np.diff(seq[order])  # (n_actions - 1,)
    d_stamp = np.diff(stamp[order]).astype(np.float64)  # (n_actions - 1,)
    step = d_seq > 0
    period_ns = 1e9 / control_hz
    deviation = np.abs(d_stamp[step] - d_seq[step] * period_ns)
    missed = int(np.sum(d_seq[d_seq > 1] - 1))
    return deviation, missed


def _level_order(levels: Sequence[int | str]) -> list[int | str]:
    """Distinct levels: integers ascending, then names in order of first appearance."""
    ints = sorted({int(v) for v in levels if not isinstance(v, str)})
    names = list(dict.fromkeys(v for v in levels if isinstance(v, str)))
    return [*ints, *names]


def _kv_bytes(actions: Sequence[ActionRecord], health: Mapping[str, Any]) -> dict[str, int]:
    """KV bytes per partition from the last action that carries them, else from the health message
    (`kv_bytes` at its top level or under `memory`), else zeros."""
    source: Mapping[str, Any] | None = None
    for action in reversed(actions):
        if action.kv_bytes:
            source = action.kv_bytes
            break
    if source is None:
        memory = health.get("memory")
        for candidate in (health.get("kv_bytes"), memory.get("kv_bytes") if isinstance(memory, Mapping) else None):
            if isinstance(candidate, Mapping) and candidate:
                source = candidate
                break
    out = {}
    for name in KV_PARTITIONS:
        value = source.get(name, 0) if source is not None else 0
        _check(is_int(value) and value >= 0, f"kv_bytes.{name}", value, "bytes as an integer >= 0")
        out[name] = int(value)
    return out


def build_report(frames: Sequence[FrameRecord], actions: Sequence[ActionRecord], meta: RunMeta) -> dict:
    """The report.json dict (exactly REPORT_KEYS, then OPTIONAL_KEYS). Latency: capture stamp -> receive of the
    first fresh action naming the frame, over processed frames. deadline_misses: those latencies above deadline_ms plus control
    ticks missed (gaps in action seq). Empty inputs give None (null), never NaN."""
    stamps, latency_ns = frame_latencies_ns(frames)
    deviation_ns, ticks_missed = control_spacing(actions, meta.control_hz)
    late_frames = int(np.sum(latency_ns > meta.deadline_ms * 1e6))
    processed = sum(1 for f in frames if f.processed)
    status_counts = {name: 0 for name in STATUSES}
    for action in actions:
        status_counts[action.status] += 1
    level_counts: dict[str, int] = {str(level): 0 for level in _level_order([a.level for a in actions])}
    for action in actions:
        level_counts[str(action.level)] += 1
    ratios = [a.reuse_ratio for a in actions if a.status == "fresh" and a.reuse_ratio is not None]
    steps = [a.denoising_steps for a in actions if a.status == "fresh" and a.denoising_steps is not None]
    return {
        "drive": meta.drive,
        "model": meta.model,
        "backend": meta.backend,
        "recipe": meta.recipe,
        "frames_sent": len(frames),
        "frames_processed": processed,
        "frames_dropped": len(frames) - processed,
        "actions": len(actions),
        "control_hz": float(meta.control_hz),
        "deadline_ms": float(meta.deadline_ms),
        "latency_ms": _percentiles(latency_ns / 1e6, NESTED_KEYS["latency_ms"]),
        "control_jitter_ms": _percentiles(deviation_ns / 1e6, NESTED_KEYS["control_jitter_ms"]),
        "deadline_misses": late_frames + ticks_missed,
        "status_counts": status_counts,
        "degrade_levels": level_counts,
        "vision_reuse_ratio": round(float(np.mean(ratios)), 4) if ratios else None,
        "kv_bytes": _kv_bytes(actions, meta.health),
        "startup_s": None if meta.startup_s is None else round(float(meta.startup_s), 3),
        "head": meta.head,
        "denoising_steps_mean": round(float(np.mean(steps)), 3) if steps else None,
        **chunk_continuity(actions),
        "stage_ms": stage_costs_ms(actions),
    }


def plot_series(frames: Sequence[FrameRecord], actions: Sequence[ActionRecord]) -> PlotSeries:
    """Time series for the HTML plots; time is seconds since the earliest stamp of the run."""
    stamps, latency_ns = frame_latencies_ns(frames)
    by_seq = sorted(actions, key=lambda a: a.seq)
    all_stamps = [f.stamp_ns for f in frames] + [a.stamp_ns for a in actions]
    t0 = min(all_stamps) if all_stamps else 0
    levels = _level_order([a.level for a in by_seq])
    level_index = {str(level): i for i, level in enumerate(levels)}
    fresh_ratio = [a for a in by_seq if a.status == "fresh" and a.reuse_ratio is not None]
    dropped = [f.stamp_ns for f in frames if not f.processed]
    stage_names = sorted({k for a in actions for k in a.timing_ms})
    stage_ms = {name: np.array([a.timing_ms[name] for a in actions if name in a.timing_ms], dtype=np.float64)
                for name in stage_names}
    return PlotSeries(
        latency_t_s=(stamps - t0) / 1e9,
        latency_ms=latency_ns / 1e6,
        dropped_t_s=(np.array(dropped, dtype=np.int64) - t0) / 1e9,
        action_t_s=(np.array([a.stamp_ns for a in by_seq], dtype=np.int64) - t0) / 1e9,
        action_status=np.array([STATUSES.index(a.status) for a in by_seq], dtype=np.int8),
        action_level=np.array([level_index[str(a.level)] for a in by_seq], dtype=np.int32),
        level_names=tuple(str(level) for level in levels),
        status_names=STATUSES,
        reuse_t_s=(np.array([a.stamp_ns for a in fresh_ratio], dtype=np.int64) - t0) / 1e9,
        reuse_ratio=np.array([a.reuse_ratio for a in fresh_ratio], dtype=np.float64),
        stage_ms=stage_ms,
    )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(report: dict, frames: Sequence[FrameRecord], actions: Sequence[ActionRecord],
                 out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write out_dir/report.json (strict JSON, indent 2) and out_dir/report.html (self-contained, inline SVG)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "report.json", out / "report.html"
    _write_atomic(json_path, json.dumps(report, indent=2, allow_nan=False) + "\n")
    _write_atomic(html_path, render_html(report, plot_series(frames, actions)))
    return json_path, html_path


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_summary(report: Mapping[str, Any]) -> str:
    """An aligned terminal table of the key figures (a few lines, no trailing newline)."""
    lat, jit, st, kv = report["latency_ms"], report["control_jitter_ms"], report["status_counts"], report["kv_bytes"]
    rows = [
        ("drive", report["drive"]),
        ("model / backend / recipe", f"{report['model']} / {report['backend']} / {report['recipe']}"),
        ("control / deadline", f"{_fmt(report['control_hz'], 1)} Hz / {_fmt(report['deadline_ms'], 1)} ms"),
        ("frames", f"{report['frames_sent']} sent, {report['frames_processed']} processed, "
                   f"{report['frames_dropped']} dropped"),
        ("actions", f"{report['actions']} (fresh {st['fresh']}, chunk {st['chunk']}, fallback {st['fallback']})"),
        ("latency ms", "  ".join(f"{k} {_fmt(lat[k]):>8}" for k in NESTED_KEYS["latency_ms"])),
        ("control jitter ms", "  ".join(f"{k} {_fmt(jit[k]):>8}" for k in NESTED_KEYS["control_jitter_ms"])),
        ("deadline misses", str(report["deadline_misses"])),
        ("degrade levels", ", ".join(f"{k}: {v}" for k, v in report["degrade_levels"].items()) or "-"),
        ("vision reuse ratio", _fmt(report["vision_reuse_ratio"], 3)),
        ("kv bytes", ", ".join(f"{k} {human_bytes(kv[k])}" for k in KV_PARTITIONS)),
        ("startup s", _fmt(report.get("startup_s"), 2) + "  (launch -> first fresh action)"),
        ("chunk boundaries", f"{report.get('chunk_boundaries', '-')}: jump {_fmt(report.get('chunk_boundary_jump'))}, "
                             f"deviation {_fmt(report.get('chunk_boundary_deviation'))} (within a chunk "
                             f"{_fmt(report.get('chunk_step_within'))})"),
    ]
    stages = report.get("stage_ms") or {}
    if stages:
        rows.append(("node ms per chunk", ", ".join(f"{stage} p50 {_fmt(v['p50'], 1)} p99 {_fmt(v['p99'], 1)}"
                                                    for stage, v in stages.items())))
    if report.get("head") == "flow":
        rows.append(("head / denoising steps", f"flow / {_fmt(report.get('denoising_steps_mean'), 2)} per chunk"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# Numeric figures compared side by side: (label, path into the report).
COMPARED = (
    ("frames sent", ("frames_sent",)),
    ("frames processed", ("frames_processed",)),
    ("frames dropped", ("frames_dropped",)),
    ("actions", ("actions",)),
    *((f"latency {k} ms", ("latency_ms", k)) for k in NESTED_KEYS["latency_ms"]),
    *((f"jitter {k} ms", ("control_jitter_ms", k)) for k in NESTED_KEYS["control_jitter_ms"]),
    ("deadline misses", ("deadline_misses",)),
    *((f"status {k}", ("status_counts", k)) for k in STATUSES),
    ("vision reuse ratio", ("vision_reuse_ratio",)),
    *((f"kv bytes {k}", ("kv_bytes", k)) for k in KV_PARTITIONS),
    ("startup s", ("startup_s",)),
    ("chunk boundary jump", ("chunk_boundary_jump",)),
    ("chunk boundary deviation", ("chunk_boundary_deviation",)),
    *((f"node {stage} ms {k}", ("stage_ms", stage, k)) for stage in ("vision", "action", "total")
      for k in ("p50", "p99")),
)


def _get(report: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    optional = path[0] in OPTIONAL_KEYS  # absent from older reports, as a stage from stage_ms: None
    value: Any = report
    for key in path:
        value = (value or {}).get(key) if optional else value[key]
    return value


def percent_change(a: Any, b: Any) -> str:
    if a is None or b is None:
        return "n/a"
    if a == b:
        return "0.0%"
    if a == 0:
        return "new"
    return f"{(b - a) / abs(a) * 100:+.1f}%"


def grew_beyond(a: float, b: float, pct: float) -> bool:
    """b exceeds a by more than pct percent; from a == 0 any increase counts."""
    return b > a if a == 0 else b > a * (1 + pct / 100)


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any], max_regression_pct: float) -> tuple[str, bool]:
    """Side-by-side text of the numeric figures of reports a (baseline) and b (candidate) with % change, and
    whether b regressed: p99 latency grew more than max_regression_pct (or b has no latency where a had one),
    or deadline misses grew (beyond the bound when a has misses, any increase when a has none)."""
    _check(is_number(max_regression_pct) and max_regression_pct >= 0,
           "max_regression_pct", max_regression_pct, "a finite number >= 0")
    pct = float(max_regression_pct)
    rows = [("figure", "a", "b", "change")]
    for label, path in COMPARED:
        va, vb = _get(a, path), _get(b, path)
        rows.append((label, _fmt(va), _fmt(vb), percent_change(va, vb)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"a: {a['drive']} ({a['model']}, {a['backend']})", f"b: {b['drive']} ({b['model']}, {b['backend']})"]
    lines += [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}" for r in rows]

    reasons = []
    p99_a, p99_b = a["latency_ms"]["p99"], b["latency_ms"]["p99"]
    if p99_a is not None and p99_b is None:
        reasons.append(f"p99 latency {_fmt(p99_a)} ms -> none (no fresh action named a processed frame)")
    elif p99_a is not None and grew_beyond(p99_a, p99_b, pct):
        reasons.append(f"p99 latency {_fmt(p99_a)} -> {_fmt(p99_b)} ms ({percent_change(p99_a, p99_b)}, "
                       f"bound {pct:g}%)")
    misses_a, misses_b = a["deadline_misses"], b["deadline_misses"]
    if grew_beyond(misses_a, misses_b, pct):
        reasons.append(f"deadline misses {misses_a} -> {misses_b} ({percent_change(misses_a, misses_b)}, "
                       f"bound {pct:g}%" + (", any increase from 0)" if misses_a == 0 else ")"))
    if reasons:
        lines.append("REGRESSED: " + "; ".join(reasons))
    else:
        lines.append(f"OK: p99 latency and deadline misses within {pct:g}%")
    return "\n".join(lines), bool(reasons)


def _validate_keys(path: str, table: Mapping[str, Any], expected: Sequence[str], prefix: str,
                   optional: Sequence[str] = ()) -> None:
    for key in expected:
        if key not in table:
            raise ReportError(f"{path}: missing key {prefix + key!r}")
    for key in table:
        if key not in expected and key not in optional:
            raise ReportError(f"{path}: unexpected key {prefix + str(key)!r}{did_you_mean(str(key), expected)}")


def _validate_value(path: str, key: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise ReportError(f"{path}: {key} = {value!r:.60}: expected {expected}")


def load_report(path: str | os.PathLike) -> dict:
    """Read a report.json, checking its exact key set and value types. Raises ReportError with a one-line
    message naming the file and the missing, unexpected or malformed key."""
    name = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{name}: cannot read: {e}") from None
    def reject_constant(constant: str) -> None:
        raise ReportError(f"{name}: {constant} is not allowed (strict JSON: null for missing figures)")

    try:
        report = json.loads(text, parse_constant=reject_constant)
    except json.JSONDecodeError as e:
        raise ReportError(f"{name}: not valid JSON: {e}") from None
    if not isinstance(report, dict):
        raise ReportError(f"{name}: expected a JSON object at the top level, got {type(report).__name__}")
    _validate_keys(name, report, REPORT_KEYS, "", OPTIONAL_KEYS)
    for key in OPTIONAL_STRING_KEYS:
        if key in report:
            _validate_value(name, key, report[key], report[key] is None or isinstance(report[key], str),
                            "a string or null")
    for key, inner in NESTED_KEYS.items():
        table = report[key]
        _validate_value(name, key, table, isinstance(table, dict), "an object")
        _validate_keys(name, table, inner, f"{key}.")
        for k in inner:
            value = table[k]
            if key in ("status_counts", "kv_bytes"):
                _validate_value(name, f"{key}.{k}", value, is_int(value) and value >= 0, "an integer >= 0")
            else:
                _validate_value(name, f"{key}.{k}", value, value is None or is_number(value, finite=False), "a number or null")
    for key in STRING_KEYS:
        _validate_value(name, key, report[key], isinstance(report[key], str), "a string")
    for key in COUNT_KEYS:
        value = report[key]
        _validate_value(name, key, value, is_int(value) and value >= 0, "an integer >= 0")
    for key in NUMBER_KEYS:
        _validate_value(name, key, report[key], is_number(report[key], finite=False), "a number")
    numbers = [k for k in OPTIONAL_KEYS if k in report and k not in (*OPTIONAL_STRING_KEYS, "stage_ms")]
    for key in (*NULLABLE_NUMBER_KEYS, *numbers):
        value = report[key]
        _validate_value(name, key, value, value is None or is_number(value, finite=False), "a number or null")
    stages = report.get("stage_ms", {})
    _validate_value(name, "stage_ms", stages, isinstance(stages, dict), "an object of stage -> figures")
    for stage, figures in stages.items():
        _validate_value(name, f"stage_ms.{stage}", figures, isinstance(figures, dict), "an object")
        _validate_keys(name, figures, STAGE_FIGURES, f"stage_ms.{stage}.")
        for k in STAGE_FIGURES:
            _validate_value(name, f"stage_ms.{stage}.{k}", figures[k], figures[k] is None or is_number(figures[k]),
                            "a number or null")
    levels = report["degrade_levels"]
    _validate_value(name, "degrade_levels", levels,
                    isinstance(levels, dict) and all(is_int(v) and v >= 0 for v in levels.values()),
                    "an object of level -> count")
    return report
