"""Latency reports: figures against hand-computed values, strict JSON, a parseable self-contained HTML page,
the terminal summary, and the regression gate of compare_reports / load_report."""

from __future__ import annotations

import dataclasses
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from vla_node.report import html as report_html
from vla_node.report.report import (
    OPTIONAL_KEYS,
    REPORT_KEYS,
    ActionRecord,
    FrameRecord,
    ReportError,
    RunMeta,
    build_report,
    compare_reports,
    format_summary,
    load_report,
    write_report,
)

MS = 1_000_000
T0 = 5_000 * 1_000_000_000  # an arbitrary CLOCK_MONOTONIC origin


def meta(control_hz: float = 50.0, deadline_ms: float = 35.0, health: dict | None = None) -> RunMeta:
    return RunMeta("drives/test.mcap", "tiny", "torch", control_hz, deadline_ms, health or {})


def frame(seq: int, latency_ms: float | None, processed: bool = True) -> FrameRecord:
    stamp = T0 + seq * 100 * MS
    first = None if latency_ms is None else stamp + int(latency_ms * MS)
    return FrameRecord(seq, stamp, stamp + MS // 2, first, processed)


def action(seq: int, stamp_ms: float, status: str = "fresh", level: int | str = 0,
           reuse: float | None = None, kv: dict | None = None, timing: dict | None = None) -> ActionRecord:
    stamp = T0 + int(stamp_ms * MS)
    return ActionRecord(stamp + MS // 5, stamp, seq, status, level, seq, stamp, timing or {"decode": 3.0}, None,
                        reuse, kv)


def ticks(n: int, period_ms: float = 20.0, **kwargs) -> list[ActionRecord]:
    return [action(i, i * period_ms, **kwargs) for i in range(n)]


# ---------------------------------------------------------------- build_report


def test_report_has_exactly_the_documented_keys():
    report = build_report([frame(0, 10.0)], ticks(3), meta())
    assert list(report) == [*REPORT_KEYS, *OPTIONAL_KEYS]
    assert set(report) == {
        "drive", "model", "backend", "recipe", "frames_sent", "frames_processed", "frames_dropped", "actions",
        "control_hz",
        "deadline_ms", "latency_ms", "control_jitter_ms", "deadline_misses", "status_counts", "degrade_levels",
        "vision_reuse_ratio", "kv_bytes", "startup_s", "head", "denoising_steps_mean", "chunk_boundaries",
        "chunk_boundary_jump", "chunk_step_within", "chunk_boundary_deviation", "stage_ms",
    }
    assert report["startup_s"] is None  # meta() names no node start
    assert report["head"] is None and report["denoising_steps_mean"] is None  # no head in health, no flow chunks
    assert set(report["latency_ms"]) == {"p50", "p90", "p99", "max"}
    assert set(report["control_jitter_ms"]) == {"p50", "p99", "max"}
    assert set(report["status_counts"]) == {"fresh", "chunk", "fallback"}
    assert set(report["kv_bytes"]) == {"text", "vision", "action"}
    assert (report["drive"], report["model"], report["backend"]) == ("drives/test.mcap", "tiny", "torch")


def played(seq: int, frame_seq: int, chunk: list, step: int, status: str = "chunk", steps: int | None = None):
    """A tick that played step `step` of `chunk` (the chunk of frame `frame_seq`)."""
    stamp = T0 + seq * 20 * MS
    return ActionRecord(stamp, stamp, seq, status, 0, frame_seq, stamp, {}, None, None, None,
                        action=tuple(chunk[step]), chunk=tuple(map(tuple, chunk)), step=step, denoising_steps=steps)


def test_chunk_continuity_separates_the_jump_at_a_boundary_from_the_chunks_own_steps():
    """Chunk A (frame 0) plays steps 0, 1; chunk B (frame 1) takes over at tick 2 playing its step 1. Within A the
    action moves by 1; at the boundary it moves from A[1] = 1 to B[1] = 5 (a jump of 4), where A had planned
    A[2] = 2 (a deviation of 3). A fallback tick and a gap in seq form no pair."""
    a = [[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]
    b = [[9.0, 0.0], [5.0, 0.0], [6.0, 0.0], [7.0, 0.0]]
    records = [played(0, 0, a, 0, "fresh", 10), played(1, 0, a, 1), played(2, 1, b, 1, "fresh", 5),
               played(3, 1, b, 2), played(5, 2, a, 0, "fresh", 10)]
    report = build_report([frame(0, 10.0)], records, meta())
    assert report["chunk_boundaries"] == 1 and report["chunk_boundary_jump"] == pytest.approx(4.0)
    assert report["chunk_boundary_deviation"] == pytest.approx(3.0)
    assert report["chunk_step_within"] == pytest.approx(1.0)
    assert report["denoising_steps_mean"] == 8.333  # fresh chunks of 10, 5 and 10 steps (rounded to 3 places)
    empty = build_report([frame(0, 10.0)], ticks(3), meta(health={"head": "bins"}))
    assert empty["chunk_boundaries"] == 0 and empty["chunk_boundary_jump"] is None


def test_stage_costs_are_counted_once_per_chunk_from_the_nodes_own_timing():
    """Frame 0's chunk (vision 40, total 41 ms) played over three ticks counts once, frame 1's (vision 60 ms, with
    a separate action stage of 8 ms) once; a fallback (no frame, no timing) not at all. p50/p99/max over the two
    chunks, linear percentiles; the figures load back, print in the summary and compare."""
    def tick(seq, frame_seq, status, timing):
        stamp = T0 + seq * 20 * MS
        return ActionRecord(stamp, stamp, seq, status, 0, frame_seq, None if frame_seq is None else stamp, timing,
                            None, None, None)

    first, second = {"vision": 40.0, "total": 41.0}, {"vision": 60.0, "action": 8.0, "total": 69.0}
    records = [tick(0, 0, "fresh", first), tick(1, 0, "chunk", first), tick(2, 0, "chunk", first),
               tick(3, 1, "chunk", second), tick(4, None, "fallback", {})]
    report = build_report([frame(0, 10.0)], records, meta())
    stages = report["stage_ms"]
    assert set(stages) == {"vision", "total", "action"}
    assert stages["vision"] == pytest.approx({"p50": 50.0, "p99": 59.8, "max": 60.0})
    assert stages["action"] == {"p50": 8.0, "p99": 8.0, "max": 8.0}
    assert "node ms per chunk" in format_summary(report) and "vision p50 50.0" in format_summary(report)
    text, regressed = compare_reports(report, report, 10.0)
    assert "node vision ms p99" in text and not regressed
    assert build_report([frame(0, 10.0)], [], meta())["stage_ms"] == {}


def test_a_report_without_stage_costs_still_loads_and_a_malformed_one_is_named(tmp_path):
    report = build_report([frame(0, 10.0)], ticks(3, timing={"vision": 5.0}), meta())
    older = {k: v for k, v in report.items() if k != "stage_ms"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(older))
    assert "stage_ms" not in load_report(path)
    text, _ = compare_reports(older, report, 10.0)
    assert "node vision ms p50" in text
    bad = dict(report, stage_ms={"vision": {"p50": 1.0, "p99": "slow", "max": 2.0}})
    path.write_text(json.dumps(bad))
    with pytest.raises(ReportError, match="stage_ms.vision.p99"):
        load_report(path)


def test_latency_percentiles_match_hand_computed_values():
    # Processed and named: 10, 20, 30, 40 ms (given out of order); one processed frame no fresh action named;
    # one dropped frame. np.percentile linear over [10, 20, 30, 40]: p50 25, p90 37, p99 39.7.
    frames = [frame(3, 40.0), frame(0, 10.0), frame(2, 30.0), frame(1, 20.0), frame(4, None), frame(5, None, False)]
    report = build_report(frames, ticks(2), meta(deadline_ms=35.0))
    assert report["latency_ms"] == pytest.approx({"p50": 25.0, "p90": 37.0, "p99": 39.7, "max": 40.0}, abs=1e-9)
    assert (report["frames_sent"], report["frames_processed"], report["frames_dropped"]) == (6, 5, 1)
    assert report["deadline_misses"] == 1  # only the 40 ms frame exceeds 35 ms; ticks 0, 1 have no gap


def test_latency_ignores_fresh_action_time_of_unprocessed_frames():
    frames = [frame(0, 10.0), frame(1, 500.0, processed=False)]
    report = build_report(frames, [], meta())
    assert report["latency_ms"]["max"] == pytest.approx(10.0)


def test_control_jitter_is_deviation_of_stamp_spacing_from_the_period():
    # 50 Hz -> 20 ms. Spacings 20, 21, 19, 20 -> deviations 0, 1, 1, 0 -> p50 0.5, p99 1.0, max 1.0.
    actions = [action(i, t) for i, t in enumerate([0.0, 20.0, 41.0, 60.0, 80.0])]
    report = build_report([], actions[::-1], meta(control_hz=50.0))  # arrival order does not matter: seq does
    assert report["control_jitter_ms"] == pytest.approx({"p50": 0.5, "p99": 1.0, "max": 1.0}, abs=1e-9)
    assert report["deadline_misses"] == 0


def test_missed_ticks_count_as_deadline_misses_and_not_as_jitter():
    # seq 0, 1, 2, 5, 6 at their nominal stamps: ticks 3 and 4 were never published; duplicate seq 6 ignored.
    actions = [action(s, s * 20.0) for s in (0, 1, 2, 5, 6)] + [action(6, 120.0)]
    frames = [frame(0, 50.0), frame(1, 10.0)]  # one late frame at deadline 35 ms
    report = build_report(frames, actions, meta(control_hz=50.0, deadline_ms=35.0))
    assert report["control_jitter_ms"]["max"] == pytest.approx(0.0)
    assert report["deadline_misses"] == 2 + 1
    assert report["actions"] == 6


def test_jitter_uses_the_control_rate_from_meta():
    actions = [action(i, i * 10.0) for i in range(4)]  # 100 Hz spacing
    assert build_report([], actions, meta(control_hz=100.0))["control_jitter_ms"]["max"] == pytest.approx(0.0)
    assert build_report([], actions, meta(control_hz=50.0))["control_jitter_ms"]["p50"] == pytest.approx(10.0)


def test_empty_run_gives_nulls_not_nan_and_strict_json():
    report = build_report([], [], meta())
    assert report["latency_ms"] == {"p50": None, "p90": None, "p99": None, "max": None}
    assert report["control_jitter_ms"] == {"p50": None, "p99": None, "max": None}
    assert report["vision_reuse_ratio"] is None
    assert report["status_counts"] == {"fresh": 0, "chunk": 0, "fallback": 0}
    assert report["degrade_levels"] == {}
    assert report["kv_bytes"] == {"text": 0, "vision": 0, "action": 0}
    assert (report["frames_sent"], report["actions"], report["deadline_misses"]) == (0, 0, 0)
    text = json.dumps(report, allow_nan=False)
    assert "NaN" not in text
    assert build_report([], [action(0, 0.0)], meta())["control_jitter_ms"]["p50"] is None  # one action: no spacing


def test_status_and_level_counts():
    statuses = ["fresh", "chunk", "chunk", "fallback", "fresh", "chunk"]
    levels = [2, 0, 0, 1, 0, 2]
    actions = [action(i, i * 20.0, status=s, level=lv) for i, (s, lv) in enumerate(zip(statuses, levels))]
    report = build_report([], actions, meta())
    assert report["status_counts"] == {"fresh": 2, "chunk": 3, "fallback": 1}
    assert report["degrade_levels"] == {"0": 3, "1": 1, "2": 2}
    assert list(report["degrade_levels"]) == ["0", "1", "2"]  # numeric order, not first appearance
    named = build_report([], [action(0, 0, level="full"), action(1, 20, level="skip_vision"),
                              action(2, 40, level="full")], meta())
    assert named["degrade_levels"] == {"full": 2, "skip_vision": 1}


def test_vision_reuse_ratio_is_the_mean_over_fresh_actions_only():
    actions = [action(0, 0, reuse=0.5), action(1, 20, reuse=0.7), action(2, 40, status="chunk", reuse=0.0),
               action(3, 60, reuse=None)]
    assert build_report([], actions, meta())["vision_reuse_ratio"] == pytest.approx(0.6)


def test_kv_bytes_from_last_action_that_has_them_else_health_else_zeros():
    kv_old, kv_new = {"text": 1, "vision": 2, "action": 3}, {"text": 10, "vision": 20, "action": 30}
    actions = [action(0, 0, kv=kv_old), action(1, 20, kv=kv_new), action(2, 40, kv=None)]
    assert build_report([], actions, meta())["kv_bytes"] == kv_new
    health = {"memory": {"kv_bytes": {"text": 7, "vision": 8}}}
    assert build_report([], ticks(2), meta(health=health))["kv_bytes"] == {"text": 7, "vision": 8, "action": 0}
    assert build_report([], ticks(2), meta(health={"kv_bytes": kv_old}))["kv_bytes"] == kv_old
    assert build_report([], ticks(2), meta(health={"rate_hz": 50}))["kv_bytes"] == {"text": 0, "vision": 0, "action": 0}


def test_records_and_meta_reject_bad_values_naming_them():
    with pytest.raises(ValueError, match=r"ActionRecord.status = 'late'.*fresh"):
        action(0, 0, status="late")
    with pytest.raises(ValueError, match=r"FrameRecord.processed"):
        FrameRecord(0, 1, 2, None, 1)
    with pytest.raises(ValueError, match=r"ActionRecord.reuse_ratio = 1.5"):
        action(0, 0, reuse=1.5)
    with pytest.raises(ValueError, match=r"RunMeta.control_hz = 0"):
        meta(control_hz=0)
    with pytest.raises(ValueError, match=r"RunMeta.deadline_ms = nan"):
        meta(deadline_ms=math.nan)


# ---------------------------------------------------------------- write_report / HTML


class TagChecker(HTMLParser):
    """Collects tags, checks nesting (void elements aside), and gathers attribute values and text."""

    VOID = {"meta", "br", "img", "hr", "input", "link", "col", "area", "base", "wbr", "source", "track"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.svg_ids: list[str] = []
        self.attr_values: list[str] = []
        self.text: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attr_values += [v or "" for _, v in attrs]
        if tag == "svg":
            self.svg_ids.append(dict(attrs).get("id", ""))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attr_values += [v or "" for _, v in attrs]

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            return
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse_html(path: Path) -> TagChecker:
    checker = TagChecker()
    checker.feed(path.read_text(encoding="utf-8"))
    checker.close()
    assert checker.errors == []
    assert checker.stack == []
    return checker


def realistic_run(n_frames: int = 60) -> tuple[list[FrameRecord], list[ActionRecord]]:
    frames = [frame(i, 20.0 + (i % 7) * 3.0 + (30.0 if i == 40 else 0.0), processed=(i % 13 != 5))
              for i in range(n_frames)]
    actions = []
    for k in range(n_frames * 5):  # 50 Hz control over 10 Hz frames
        status = "fallback" if 100 <= k < 110 else ("fresh" if k % 3 == 0 else "chunk")
        actions.append(action(k, k * 20.0 + (k % 5) * 0.3, status=status, level=1 if 90 <= k < 130 else 0,
                              reuse=0.4 + (k % 10) / 20 if status == "fresh" else None,
                              kv={"text": 300_000, "vision": 5_400_000, "action": 80_000},
                              timing={"vision": 4.0 + k % 3, "decode": 8.0}))
    return frames, actions


def test_write_report_writes_strict_json_and_self_contained_html(tmp_path):
    frames, actions = realistic_run()
    drive = 'drives/<script>alert("x")</script> & co.mcap'
    report = build_report(frames, actions, RunMeta(drive, "tiny", "torch", 50.0, 35.0, {}))
    json_path, html_path = write_report(report, frames, actions, tmp_path / "out")
    assert (json_path.name, html_path.name) == ("report.json", "report.html")
    assert json.loads(json_path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) == report
    assert json_path.read_text().startswith('{\n  "drive"')  # indent 2

    page = html_path.read_text(encoding="utf-8")
    checker = parse_html(html_path)
    assert checker.svg_ids == list(report_html.PLOT_IDS)
    assert page.count("<svg") == len(report_html.PLOT_IDS)
    assert "http://" not in page and "https://" not in page
    assert not any(tag in checker.tags for tag in ("script", "img", "link", "iframe"))
    assert "<script>alert" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; co.mcap" in page
    text = " ".join(checker.text)
    for caption in ("latency (ms)", "time since start (s)", "degrade level", "deadline 35 ms", "frames",
                    "fresh", "fallback", "bytes (MiB)", "vision", "decode"):
        assert caption in text, caption
    assert f"{report['latency_ms']['p99']:g}" in text  # the summary table carries the figures


def test_html_of_an_empty_run_still_has_every_plot(tmp_path):
    report = build_report([], [], meta())
    _, html_path = write_report(report, [], [], tmp_path)
    checker = parse_html(html_path)
    assert checker.svg_ids == list(report_html.PLOT_IDS)
    assert "no actions received" in " ".join(checker.text)


def test_long_run_page_stays_small_and_keeps_spikes(tmp_path):
    n = 6000
    frames = [frame(i, 20.0 + (i % 11), processed=True) for i in range(n)]
    frames[4321] = frame(4321, 95.0)  # one spike among thousands must stay visible
    actions = [action(k, k * 20.0, status="fallback" if k == 9000 else "chunk") for k in range(3 * n)]
    report = build_report(frames, actions, meta(deadline_ms=50.0))
    _, html_path = write_report(report, frames, actions, tmp_path)
    parse_html(html_path)
    assert html_path.stat().st_size < 300_000
    page = html_path.read_text()
    latency_svg = page[page.index('id="plot-latency-time"'):page.index("</svg>", page.index('id="plot-latency-time"'))]
    assert latency_svg.count("<circle") == 1  # the one late frame, marked
    fallback_colour = report_html.STATUS_COLOURS["fallback"]
    status_svg = page[page.index('id="plot-level-status"'):]
    assert f'fill="{fallback_colour}"/>' in status_svg.split("</svg>")[0]  # 1 fallback among 18000 ticks shows


def test_line_decimation_keeps_min_and_max_per_column():
    frame_ = report_html._Frame(0.0, 1.0, 0.0, 100.0)
    x = np.linspace(0.0, 1.0, 50_000)
    y = np.full_like(x, 10.0)
    y[12_345], y[40_000] = 99.0, 0.5
    points = report_html._line_points(frame_, x, y).split()
    assert len(points) <= 2 * frame_.plot_w + 2
    ys = [float(p.split(",")[1]) for p in points]
    assert min(ys) == pytest.approx(float(frame_.py(99.0)), abs=0.06)
    assert max(ys) == pytest.approx(float(frame_.py(0.5)), abs=0.06)


@pytest.mark.parametrize("lo, hi", [(0.0, 73.0), (0.0, 0.004), (3.2, 3.2), (0.0, 1e9), (-5.0, 17.0)])
def test_nice_ticks_cover_the_range_with_round_steps(lo, hi):
    lo_n, hi_n, ticks_, decimals = report_html.nice_ticks(lo, hi)
    assert lo_n <= lo and hi_n >= hi and hi_n > lo_n
    assert 2 <= len(ticks_) <= 13
    step = ticks_[1] - ticks_[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-6
    labels = [f"{t:.{decimals}f}" for t in ticks_]
    assert len(set(labels)) == len(labels)  # enough decimals to tell ticks apart


# ---------------------------------------------------------------- format_summary


def test_format_summary_is_an_aligned_table_of_key_figures():
    frames, actions = realistic_run()
    report = build_report(frames, actions, meta())
    text = format_summary(report)
    lines = text.splitlines()
    assert 5 <= len(lines) <= 16
    value_column = {len(line) - len(line[line.index("  "):].lstrip()) for line in lines}
    assert len(value_column) == 1  # every value starts in the same column
    rows = {line[:20].strip(): line[20:].split() for line in lines}  # label column, then the values
    assert rows["latency ms"][rows["latency ms"].index("p99") + 1] == f"{report['latency_ms']['p99']:.3f}"
    assert rows["frames"][4:6] == [str(report["frames_dropped"]), "dropped"]
    assert rows["deadline misses"] == [str(report["deadline_misses"])]
    empty = {line[:20].strip(): line[20:].split() for line in format_summary(build_report([], [], meta())).splitlines()}
    assert empty["latency ms"] == ["p50", "-", "p90", "-", "p99", "-", "max", "-"]  # nulls print as a dash
    assert empty["vision reuse ratio"] == ["-"] and empty["deadline misses"] == ["0"]


# ---------------------------------------------------------------- compare / load


def base_report() -> dict:
    frames, actions = realistic_run()
    return build_report(frames, actions, meta())


def test_compare_passes_an_identical_pair():
    a = base_report()
    text, regressed = compare_reports(a, json.loads(json.dumps(a)), 10.0)
    assert not regressed
    assert "latency p99 ms" in text and "OK" in text and "REGRESSED" not in text


def test_compare_catches_a_planted_p99_regression_only_beyond_the_bound():
    a = base_report()
    b = json.loads(json.dumps(a))
    b["latency_ms"]["p99"] = a["latency_ms"]["p99"] * 1.25
    text, regressed = compare_reports(a, b, 10.0)
    assert regressed and "REGRESSED" in text and "p99 latency" in text and "+25.0%" in text
    assert not compare_reports(a, b, 30.0)[1]
    b["latency_ms"]["p99"] = None  # b no longer produced a single fresh action for a processed frame
    assert compare_reports(a, b, 30.0)[1]


def test_compare_catches_more_deadline_misses():
    a, b = base_report(), base_report()
    a["deadline_misses"], b["deadline_misses"] = 0, 1
    text, regressed = compare_reports(a, b, 50.0)
    assert regressed and "deadline misses 0 -> 1" in text  # any increase from zero
    a["deadline_misses"], b["deadline_misses"] = 10, 12
    assert compare_reports(a, b, 10.0)[1]  # +20% > 10%
    assert not compare_reports(a, b, 25.0)[1]
    assert not compare_reports(b, a, 0.0)[1]  # fewer misses is not a regression


def test_compare_rejects_a_bad_bound():
    with pytest.raises(ValueError, match="max_regression_pct"):
        compare_reports(base_report(), base_report(), -1)


def test_startup_is_reported_loaded_and_compared_and_older_reports_without_it_still_load(tmp_path):
    frames, actions = realistic_run()
    report = build_report(frames, actions, dataclasses.replace(meta(), startup_s=3.21234))
    assert report["startup_s"] == 3.212
    json_path, _ = write_report(report, frames, actions, tmp_path)
    assert load_report(json_path) == report
    assert "startup s" in format_summary(report) and "3.21" in format_summary(report)
    older = {k: v for k, v in report.items() if k != "startup_s"}  # a report written before startup_s
    (tmp_path / "older.json").write_text(json.dumps(older))
    text, _ = compare_reports(load_report(tmp_path / "older.json"), report, 5.0)
    assert any(line.startswith("startup s") and "n/a" in line for line in text.splitlines())
    with pytest.raises(ValueError, match="startup_s"):
        dataclasses.replace(meta(), startup_s=-1.0)
    (tmp_path / "bad.json").write_text(json.dumps({**report, "startup_s": "soon"}))
    with pytest.raises(ReportError, match="startup_s"):
        load_report(tmp_path / "bad.json")


def test_load_report_round_trips_what_write_report_wrote(tmp_path):
    frames, actions = realistic_run()
    report = build_report(frames, actions, meta())
    json_path, _ = write_report(report, frames, actions, tmp_path)
    assert load_report(json_path) == report
    text, regressed = compare_reports(load_report(json_path), load_report(json_path), 5.0)
    assert not regressed


@pytest.mark.parametrize("mutate, expected", [
    (lambda r: r.pop("deadline_misses"), "missing key 'deadline_misses'"),
    (lambda r: r["latency_ms"].pop("p99"), "missing key 'latency_ms.p99'"),
    (lambda r: r.update(deadline_mises=3), "unexpected key 'deadline_mises'"),
    (lambda r: r.update(deadline_misses="3"), "deadline_misses = '3'"),
])
def test_load_report_rejects_a_bad_key_set_with_a_one_line_message(tmp_path, mutate, expected):
    report = base_report()
    mutate(report)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ReportError) as info:
        load_report(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path)) and expected in message


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ('{"latency_ms": NaN}', "NaN is not allowed"),
    ("[1, 2]", "expected a JSON object"),
])
def test_load_report_rejects_malformed_files(tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=expected):
        load_report(path)
    with pytest.raises(ReportError, match="cannot read"):
        load_report(tmp_path / "missing.json")


def test_status_band_shows_a_single_fallback_among_many_ticks_per_pixel():
    n = 100_000  # about 140 ticks per pixel column: one fallback would round to zero pixels
    status = np.zeros(n, dtype=np.int8)
    status[n // 2] = 2
    empty = np.zeros(0)
    series = report_html.PlotSeries(
        latency_t_s=empty, latency_ms=empty, dropped_t_s=empty, action_t_s=np.arange(n) * 0.02,
        action_status=status, action_level=np.zeros(n, dtype=np.int32), level_names=("0",),
        status_names=("fresh", "chunk", "fallback"), reuse_t_s=empty, reuse_ratio=empty, stage_ms={})
    svg = report_html.level_status_svg(series)
    fallback_rects = [line for line in svg.splitlines()
                      if f'fill="{report_html.STATUS_COLOURS["fallback"]}"/>' in line and "<rect" in line]
    band = [line for line in fallback_rects if 'height="10"' not in line]  # the legend swatch is 10 x 10
    assert len(band) == 1 and 'height="1"' in band[0]
    assert svg.count("<rect") < 20  # runs of identical columns are merged
