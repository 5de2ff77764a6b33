"""Replay: drives of every kind through a real tiny node and through a stand-in node built from the node's own
transport (real ZeroMQ sockets), pixel exactness on the wire, timing, commands, loops, closed loop, errors."""

from __future__ import annotations

import sys

import pytest

from helpers.drive_checks import check_report
from helpers.node_helpers import (
    TINY_LAUNCH,
    EchoNode,
    crc,
    mp4_pixels,
    start_tiny_node,
)
from vla_node.drives.convert import convert_video
from vla_node.drives.replay import replay
from vla_node.node.process import private_addresses

pytestmark = pytest.mark.realtime  # real nodes and replays at the recorded rate

CLIPS = ("day_freeway_solid_white_right.mp4", "day_freeway_two_cars.mp4", "day_freeway_tree_shadows.mp4")


# ---- against the stand-in node: exact, deterministic -----------------------------------------------------
def test_convert_then_replay_delivers_the_mp4_pixels_exactly(tmp_path, drives_dir):
    clip = drives_dir / "day_freeway_two_cars.mp4"
    source = mp4_pixels(clip)  # 38 frames of 1280x720, decoded straight with PyAV
    drive = tmp_path / "two_cars.mcap"
    convert_video(clip, drive, max_frames=12, progress=False)
    addresses = private_addresses()
    with EchoNode(addresses) as echo:
        report, json_path, html_path = replay(drive, TINY_LAUNCH, connect=True, addresses=addresses,
                                              out_dir=tmp_path / "native", progress=False)
    assert [f.seq for f in echo.frames] == list(range(12)) and not echo.rejects
    assert all(f.encoding == "rgb8" and f.shape == (720, 1280, 3) for f in echo.frames)
    assert [f.crc for f in echo.frames] == [crc(rgb) for rgb in source[:12]]
    check_report(report, json_path, html_path, 12)
    assert report["frames_processed"] == 12 and report["latency_ms"]["p50"] is not None
    assert report["model"] == "echo" and report["kv_bytes"] == {"text": 1, "vision": 2, "action": 3}

    with EchoNode(addresses) as echo:  # the mp4 itself, every frame
        report, *_ = replay(clip, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "mp4",
                            progress=False)
    assert [f.crc for f in echo.frames] == [crc(rgb) for rgb in source]
    assert report["frames_sent"] == report["frames_processed"] == 38


# ---- errors before anything starts ------------------------------------------------------------------------


# ---- through the real tiny node -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_node(tmp_path_factory):
    """One real node process for the module; each replay connects to it."""
    node, addresses = start_tiny_node(tmp_path_factory.mktemp("node") / "node.log")
    yield addresses
    assert node.stop() == 0, node.tail()
@pytest.mark.parametrize("clip", CLIPS)
def test_real_clips_replay_through_the_node(tmp_path, drives_dir, tiny_node, clip):
    drive = tmp_path / "clip.mcap"
    convert_video(drives_dir / clip, drive, size=(320, 180), max_frames=20, progress=False)
    report, json_path, html_path = replay(drive, TINY_LAUNCH, connect=True, addresses=tiny_node,
                                          out_dir=tmp_path / "out", progress=False)
    check_report(report, json_path, html_path, 20)
    assert report["frames_processed"] > 0 and report["model"] == "tiny"
    assert report["frames_processed"] + report["frames_dropped"] == 20
    assert report["kv_bytes"]["text"] > 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
