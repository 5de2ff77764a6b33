"""The demo: synthetic drive -> node -> report, with nothing but the package (tiny model to stay fast)."""

from __future__ import annotations

from helpers.node_helpers import TINY_LAUNCH
from vla_node.drives.demo import demo
from vla_node.drives.open import open_drive
from vla_node.report.report import OPTIONAL_KEYS, REPORT_KEYS, load_report


def test_demo_ends_with_a_report_and_says_where(tmp_path, capsys):
    out = tmp_path / "demo"
    report, json_path, html_path = demo(out, seconds=2, launch=TINY_LAUNCH, progress=False)
    assert json_path == out / "report.json" and html_path == out / "report.html"
    assert load_report(json_path) == report and tuple(report) == (*REPORT_KEYS, *OPTIONAL_KEYS)
    assert 0 < report["startup_s"] < 300  # launch -> the first fresh action
    drive = open_drive(out / "synthetic.mcap")
    assert drive.frame_count == 20 and drive.info().sizes == {"front": (640, 480)}
    assert report["frames_sent"] == 20 and report["frames_processed"] > 0
    printed = capsys.readouterr().out
    assert f"Open {html_path} in a browser" in printed and "latency ms" in printed


