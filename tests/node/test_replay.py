"""Replay: drives of every kind through a real tiny node and through a stand-in node built from the node's own
transport (real ZeroMQ sockets), pixel exactness on the wire, timing, commands, loops, closed loop, errors."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from helpers.drive_checks import check_report, native_drive
from helpers.node_helpers import (
    TINY_LAUNCH,
    EchoNode,
    crc,
    mp4_pixels,
    road_frames,
    start_tiny_node,
    write_mp4,
    write_ros2_bag,
)
from vla_node.drives.convert import convert_video
from vla_node.drives.open import DriveError, DriveWriter, open_drive
from vla_node.drives.replay import replay
from vla_node.node.process import NodeProcessError, private_addresses
from vla_node.report.report import load_report


# ---- against the stand-in node: exact, deterministic -----------------------------------------------------
def test_replay_is_pixel_exact_for_rgb8_and_byte_exact_for_jpeg(tmp_path):
    video = tmp_path / "road.mp4"
    write_mp4(video, road_frames(12))
    source = mp4_pixels(video)
    assert len(source) == 12
    rgb_drive, jpeg_drive = tmp_path / "rgb.mcap", tmp_path / "jpeg.mcap"
    convert_video(video, rgb_drive, progress=False)
    convert_video(video, jpeg_drive, encoding="jpeg", progress=False)
    addresses = private_addresses()
    with EchoNode(addresses) as echo:
        replay(rgb_drive, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "a",
               progress=False, rate=4.0)
    assert [f.crc for f in echo.frames] == [crc(rgb) for rgb in source]
    with EchoNode(addresses) as echo:
        replay(jpeg_drive, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "b",
               progress=False, rate=4.0)
    stored = list(open_drive(jpeg_drive).frames())
    assert all(f.encoding == "jpeg" for f in echo.frames)
    assert [f.payload_crc for f in echo.frames] == [zlib.crc32(f.payload) for f in stored]
def test_timing_rate_loops_and_commands(tmp_path):
    frames = road_frames(6, 64, 48)
    commands = [(0, "instruction", {"text": "turn left at the light"}),
                (250_000_000, "state", {"values": [1.5, -2.0, 0.25]}),
                (260_000_000, "instruction", {"text": "stop"})]
    drive = native_drive(tmp_path / "cmd.mcap", frames, fps=10.0, commands=commands)
    addresses = private_addresses()
    with EchoNode(addresses) as echo:
        report, *_ = replay(drive, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "out",
                            progress=False, rate=2.0, loop=2)
    got = echo.frames
    assert [f.seq for f in got] == list(range(12))  # numbering continues over loops
    assert [f.crc for f in got] == [crc(rgb) for rgb in frames] * 2
    stamps = np.array([f.stamp_ns for f in got])
    assert np.all(np.diff(stamps) > 0)
    # never early: frame k of loop n is due (n x 600 ms + k x 100 ms) / rate after the start (a loop spans the
    # drive plus one frame period); 10 ms of slack for the first frame's own send delay
    due = np.array([(n * 600 + k * 100) * 1e6 / 2.0 for n in range(2) for k in range(6)])
    assert np.all(stamps - stamps[0] >= due - 10e6)
    texts = [c.text for c in echo.commands if hasattr(c, "text")]
    states = [c.values.tolist() for c in echo.commands if hasattr(c, "values")]
    assert texts == ["turn left at the light", "stop"] * 2
    assert states == [[1.5, -2.0, 0.25]] * 2
    seqs = [c.seq for c in echo.commands]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # a node keeps the newest instruction by seq
    assert report["frames_sent"] == report["frames_processed"] == 12
def test_as_fast_as_possible_waits_for_each_answer_not_for_the_recorded_timing(tmp_path):
    frames = road_frames(8, 64, 48)
    drive = native_drive(tmp_path / "slow.mcap", frames, fps=1.0)  # 7 s as recorded
    addresses = private_addresses()
    start = time.monotonic()
    with EchoNode(addresses) as echo:
        report, *_ = replay(drive, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "a",
                            progress=False, as_fast_as_possible=True)
    streamed = time.monotonic() - start
    assert [f.crc for f in echo.frames] == [crc(rgb) for rgb in frames]
    # one frame in flight: each frame is stamped after the stand-in answered the previous one
    assert all(b.stamp_ns > a.arrival_ns for a, b in zip(echo.frames, echo.frames[1:]))
    assert report["frames_processed"] == 8 and streamed < 6.0

    with EchoNode(addresses, answer=False) as echo:  # a node that never answers: each frame times out
        report, *_ = replay(drive, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "b",
                            progress=False, as_fast_as_possible=True)
    gaps = np.diff([f.stamp_ns for f in echo.frames])
    assert len(echo.frames) == 8 and np.all(gaps >= 0.4e9 - 2e6)  # max(2 x 200 ms deadline, 0.2 s)
    assert report["frames_processed"] == 0 and report["latency_ms"]["p50"] is None
def test_a_drive_corrupt_midway_stops_the_replay_with_a_one_line_error(tmp_path):
    path = tmp_path / "mid.mcap"
    with DriveWriter(path, chunk_size=16 * 1024) as writer:
        for i, rgb in enumerate(road_frames(12, 64, 48)):
            writer.add_frame("front", i, i * 100_000_000, "rgb8", 48, 64, rgb.tobytes())
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\x00" * 64  # a later chunk; the first one stays readable
    path.write_bytes(bytes(data))
    addresses = private_addresses()
    with EchoNode(addresses) as echo, pytest.raises(DriveError) as err:
        replay(path, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "out", progress=False,
               rate=10.0)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert 0 < len(echo.frames) < 12
def test_ctrl_c_stops_early_writes_the_report_and_is_re_raised(tmp_path):
    drive = native_drive(tmp_path / "long.mcap", road_frames(40, 64, 48))  # 4 s
    addresses = private_addresses()
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    with EchoNode(addresses) as echo, pytest.raises(KeyboardInterrupt):
        timer.start()
        replay(drive, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "out", progress=False)
    report = load_report(tmp_path / "out" / "report.json")
    assert 0 < report["frames_sent"] < 40 and report["frames_sent"] == len(echo.frames)


# ---- errors before anything starts ------------------------------------------------------------------------


def one_line(err: pytest.ExceptionInfo, *fragments: str) -> None:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    for fragment in fragments:
        assert fragment in text
def test_connect_without_a_node_times_out_with_a_clear_error(tmp_path):
    drive = native_drive(tmp_path / "d.mcap", road_frames(2, 64, 48))
    with pytest.raises(NodeProcessError) as err:
        replay(drive, TINY_LAUNCH, connect=True, addresses=private_addresses(), out_dir=tmp_path / "o",
               warmup_timeout_s=1.0, progress=False)
    one_line(err, "no node answered within 1 s", "vla-node run --launch")
def test_a_node_that_dies_is_an_error_with_its_exit_code_and_log(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\nprint('simulated node failure: out of memory', file=sys.stderr, flush=True)\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    drive = native_drive(tmp_path / "d.mcap", road_frames(2, 64, 48))
    with pytest.raises(NodeProcessError) as err:
        replay(drive, TINY_LAUNCH, out_dir=tmp_path / "o", progress=False)
    text = str(err.value)
    assert "the node exited with code 3 during start-up" in text
    assert "simulated node failure: out of memory" in text and str(tmp_path / "o" / "node.log") in text


# ---- through the real tiny node -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_node(tmp_path_factory):
    """One real node process for the module; each replay connects to it."""
    node, addresses = start_tiny_node(tmp_path_factory.mktemp("node") / "node.log")
    yield addresses
    assert node.stop() == 0, node.tail()
@pytest.mark.parametrize("compressed", [False, True], ids=["Image", "CompressedImage"])
def test_ros2_bags_replay_through_the_node(tmp_path, tiny_node, compressed):
    bag = tmp_path / "bag.mcap"
    write_ros2_bag(bag, road_frames(15), compressed=compressed)
    report, json_path, html_path = replay(bag, TINY_LAUNCH, connect=True, addresses=tiny_node,
                                          out_dir=tmp_path / "out", progress=False)
    check_report(report, json_path, html_path, 15)
    assert report["frames_processed"] > 0
def test_an_mp4_replays_through_a_node_the_replay_starts(tmp_path, capsys):
    video = tmp_path / "road.mp4"
    write_mp4(video, road_frames(20))
    out = tmp_path / "out"
    report, json_path, html_path = replay(video, TINY_LAUNCH, out_dir=out, progress=False)
    check_report(report, json_path, html_path, 20)
    assert report["frames_processed"] > 0
    printed = capsys.readouterr().out
    assert "waiting for the node" in printed and "node ready after" in printed
    assert f"report: {json_path}" in printed and "latency ms" in printed
    assert "node stopped cleanly" in (out / "node.log").read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
