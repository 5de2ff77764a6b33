"""`vla-node replay | record | demo` through the CLI's entry point: user errors are one line and exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.cli_checks import error_line, tiny_drive
from helpers.node_helpers import TINY_LAUNCH
from vla_node.cli import main
from vla_node.drives.open import DriveWriter


def test_replay_user_errors_exit_2_with_one_line(tmp_path, capsys):
    cut = tiny_drive(tmp_path / "cut.mcap")
    cut.write_bytes(cut.read_bytes()[:-100])
    out = str(tmp_path / "out")
    assert main(["replay", str(cut), "--launch", str(TINY_LAUNCH), "--out", out]) == 2
    error_line(capsys, "replay", str(cut), "truncated MCAP")
    good = tiny_drive(tmp_path / "good.mcap")
    assert main(["replay", str(good), "--launch", str(TINY_LAUNCH), "--topic", "/nope", "--out", out]) == 2
    error_line(capsys, "replay", "no image topic '/nope'")
    assert main(["replay", str(good), "--launch", str(TINY_LAUNCH), "--rate", "-1", "--out", out]) == 2
    error_line(capsys, "replay", "rate")
    assert main(["replay", str(tmp_path / "missing.mcap"), "--launch", str(TINY_LAUNCH), "--out", out]) == 2
    error_line(capsys, "replay", "no such file")
    bad = tmp_path / "bad_command.mcap"
    with DriveWriter(bad) as writer:
        writer.add_frame("front", 0, 0, "rgb8", 8, 8, bytes(192))
        writer.add_message("instruction", 10_000_000, {"v": 1, "seq": 0, "stamp_ns": 10_000_000, "instr": "left"})
    assert main(["replay", str(bad), "--launch", str(TINY_LAUNCH), "--out", out]) == 2  # before any node starts
    error_line(capsys, "replay", str(bad), "recorded instruction at 10000000 ns", "text = None")
def test_record_and_demo_user_errors_exit_2(tmp_path, capsys):
    existing = tmp_path / "exists.mcap"
    existing.write_bytes(b"x")
    assert main(["record", "--launch", str(TINY_LAUNCH), "--out", str(existing), "--duration", "1"]) == 2
    error_line(capsys, "record", "exists")
    assert main(["demo", "--seconds", "0", "--out", str(tmp_path / "demo")]) == 2
    error_line(capsys, "demo", "seconds")
    assert main(["record", "--launch", str(TINY_LAUNCH), "--out", str(tmp_path / "inf.mcap"), "--duration", "inf"]) == 2
    error_line(capsys, "record", "duration_s = inf")
    assert not (tmp_path / "inf.mcap").exists()
    # argument checks below the CLI raise ConfigError, one of the user errors (report compare: exit 1 = regressed)
    from vla_node.report.report import compare_reports
    from vla_node.validate import ConfigError

    with pytest.raises(ConfigError, match="max_regression_pct = -5"):
        compare_reports({}, {}, -5)
def test_the_installed_command_prints_no_traceback(tmp_path):
    corrupt = tmp_path / "corrupt.mcap"
    corrupt.write_bytes(b"\x89MCAP0\r\n" + b"\x00" * 64 + b"\x89MCAP0\r\n")
    result = subprocess.run([sys.executable, "-m", "vla_node.cli", "replay", str(corrupt), "--launch",
                             str(TINY_LAUNCH), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("vla-node replay: error: ") and str(corrupt) in lines[-1]




