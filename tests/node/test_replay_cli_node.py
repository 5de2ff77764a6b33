"""`vla-node replay | record | demo` through the CLI's entry point: user errors are one line and exit 2."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cli_checks import error_line, tiny_drive
from helpers.node_helpers import TINY_LAUNCH
from vla_node.cli import main
from vla_node.drives.open import DriveWriter
from vla_node.node.process import private_addresses


def test_replay_connect_without_a_node_exits_2(tmp_path, capsys):
    addresses = private_addresses()
    drive = tiny_drive(tmp_path / "d.mcap")
    argv = ["replay", str(drive), "--launch", str(TINY_LAUNCH), "--connect", "--warmup-timeout", "1",
            "--out", str(tmp_path / "out"), "--no-progress"]
    for key, address in addresses.items():
        argv += [f"--{key}", address]
    assert main(argv) == 2
    error_line(capsys, "replay", "no node answered within 1 s")


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
