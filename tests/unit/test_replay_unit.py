"""Replay: drives of every kind through a real tiny node and through a stand-in node built from the node's own
transport (real ZeroMQ sockets), pixel exactness on the wire, timing, commands, loops, closed loop, errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from helpers.drive_checks import native_drive
from helpers.node_helpers import (
    TINY_LAUNCH,
    road_frames,
    write_ros2_bag,
)
from vla_node.cli import build_parser
from vla_node.drives.open import DriveError, DriveWriter
from vla_node.drives.replay import replay
from vla_node.validate import ConfigError

# ---- against the stand-in node: exact, deterministic -----------------------------------------------------


# ---- errors before anything starts ------------------------------------------------------------------------


def one_line(err: pytest.ExceptionInfo, *fragments: str) -> None:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    for fragment in fragments:
        assert fragment in text
def test_bad_drives_and_arguments_fail_with_one_line_before_starting_a_node(tmp_path):
    out = tmp_path / "out"
    good = native_drive(tmp_path / "good.mcap", road_frames(4, 64, 48))
    cut = tmp_path / "cut.mcap"
    cut.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(DriveError) as err:
        replay(cut, TINY_LAUNCH, out_dir=out)
    one_line(err, str(cut), "truncated MCAP")
    with pytest.raises(DriveError) as err:
        replay(good, TINY_LAUNCH, topic="/camera/left", out_dir=out)
    one_line(err, "no image topic '/camera/left'", "frame/front")

    yuv = tmp_path / "yuv.mcap"
    write_ros2_bag(yuv, road_frames(2, 64, 48), compressed=False, encoding="yuv9")
    with pytest.raises(DriveError) as err:
        replay(yuv, TINY_LAUNCH, out_dir=out)
    one_line(err, "unsupported image encoding 'yuv9'")

    big = native_drive(tmp_path / "big.mcap", [np.zeros((1100, 2000, 3), np.uint8)])
    with pytest.raises(DriveError) as err:
        replay(big, TINY_LAUNCH, out_dir=out)
    one_line(err, "2000x1100", "at most 1920x1080")

    two = tmp_path / "two.mcap"
    with DriveWriter(two) as writer:
        for camera in ("left", "right"):
            writer.add_frame(camera, 0, 0, "rgb8", 8, 8, bytes(192))
    with pytest.raises(DriveError) as err:
        replay(two, TINY_LAUNCH, out_dir=out)
    one_line(err, "the node takes cameras ['front']", "--topic")

    not_a_drive = tmp_path / "notes.txt"
    not_a_drive.write_text("hello")
    with pytest.raises(DriveError) as err:
        replay(not_a_drive, TINY_LAUNCH, out_dir=out)
    one_line(err, "not a drive")

    for kwargs, key in (({"rate": 0}, "rate"), ({"loop": 0}, "loop"), ({"addresses": {"frame": "x"}}, "addresses")):
        with pytest.raises(ConfigError) as err:
            replay(good, TINY_LAUNCH, out_dir=out, **kwargs)
        one_line(err, key)
    assert not (out / "node.log").exists()  # nothing was started
def test_the_command_function_takes_parsed_arguments(tmp_path):
    parser = build_parser()
    cut = tmp_path / "cut.mcap"
    native_drive(cut, road_frames(2, 64, 48))
    cut.write_bytes(cut.read_bytes()[:100])
    args = parser.parse_args(["replay", str(cut), "--launch", str(TINY_LAUNCH), "--rate", "2", "--loop", "3",
                              "--out", str(tmp_path / "o"), "--frames", "ipc://@x-frames"])
    assert (args.rate, args.loop, args.frames, args.as_fast_as_possible) == (2.0, 3, "ipc://@x-frames", False)
    with pytest.raises(DriveError, match="truncated MCAP"):
        args.func(args)
    with pytest.raises(SystemExit):  # --rate and --as-fast-as-possible exclude each other
        parser.parse_args(["replay", str(cut), "--rate", "2", "--as-fast-as-possible"])


# ---- through the real tiny node -----------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
