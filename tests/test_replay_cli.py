"""`vla-node replay | record | demo` through the CLI's entry point: user errors are one line and exit 2.

Needs the lead's wiring in cli.py (subcommands built with replay.add_replay_arguments / replay.replay_command,
record.add_record_arguments / record.record_command, demo.add_demo_arguments / demo.demo_command, and
replay.NodeProcessError among the user errors)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node_helpers import TINY_LAUNCH
from vla_node.cli import main
from vla_node.drive import DriveWriter
from vla_node.node_process import private_addresses


def tiny_drive(path):
    with DriveWriter(path) as writer:
        for i in range(3):
            writer.add_frame("front", i, i * 100_000_000, "rgb8", 8, 8, bytes(192))
    return path


def error_line(capsys, command: str, *fragments: str) -> None:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith(f"vla-node {command}: error: ")
    for fragment in fragments:
        assert fragment in last


@pytest.mark.unit
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


@pytest.mark.node
def test_replay_connect_without_a_node_exits_2(tmp_path, capsys):
    addresses = private_addresses()
    drive = tiny_drive(tmp_path / "d.mcap")
    argv = ["replay", str(drive), "--launch", str(TINY_LAUNCH), "--connect", "--warmup-timeout", "1",
            "--out", str(tmp_path / "out"), "--no-progress"]
    for key, address in addresses.items():
        argv += [f"--{key}", address]
    assert main(argv) == 2
    error_line(capsys, "replay", "no node answered within 1 s")


@pytest.mark.unit
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
    from vla_node.report import compare_reports
    from vla_node.validate import ConfigError

    with pytest.raises(ConfigError, match="max_regression_pct = -5"):
        compare_reports({}, {}, -5)


@pytest.mark.unit
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


def _running_with(fragment: str) -> list[int]:
    """Pids of this host's processes whose command line contains `fragment`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if fragment in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.node
@pytest.mark.parametrize("when", ["waiting for the node", "node ready"])  # in the warm-up, in the stream
def test_sigterm_to_the_replay_stops_the_node_it_started(tmp_path, when):
    """The node runs in its own session (a terminal's Ctrl-C reaches only the replay); SIGTERM from timeout, CI
    or systemd must not leave it running after the replay is gone."""
    addresses = private_addresses()
    drive = tmp_path / "long.mcap"
    with DriveWriter(drive) as writer:
        for i in range(100):  # 10 s at 1x
            writer.add_frame("front", i, i * 100_000_000, "rgb8", 8, 8, bytes(192))
    argv = [sys.executable, "-m", "vla_node.cli", "replay", str(drive), "--launch", str(TINY_LAUNCH), "--out",
            str(tmp_path / "out"), "--no-progress"]
    for key, address in addresses.items():
        argv += [f"--{key}", address]
    replay = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in replay.stdout:
            lines.append(line)
            if when in line:
                break
        assert set(_running_with(addresses["frames"])) - {replay.pid}, "".join(lines)  # the node is up
        replay.send_signal(signal.SIGTERM)
        code = replay.wait(timeout=60)
    finally:
        if replay.poll() is None:
            replay.kill()
    assert code in (130, 143), code  # stopped like Ctrl-C in the stream, exited in the warm-up
    deadline = time.monotonic() + 10
    while _running_with(addresses["frames"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running_with(addresses["frames"])
