"""The shared real clips (their manifest) and small mp4 files written for tests."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest

from helpers.paths import DRIVES_DIR as DRIVES


def manifest() -> list[dict]:
    path = DRIVES / "manifest.json"
    if not path.is_file():
        return []
    return json.loads(path.read_text())


def clip(entry: dict) -> Path:
    path = DRIVES / entry["file"]
    if not path.is_file():
        pytest.skip(f"real drive {path} is absent (set VLA_NODE_DRIVES to the folder of the dashcam clips)")
    return path


def write_mp4(path: Path, frames: list[np.ndarray], fps: int = 25) -> None:
    """A small H.264 mp4 from RGB frames (so video tests need no footage)."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "ultrafast"}
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
