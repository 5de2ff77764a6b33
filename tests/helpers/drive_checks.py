"""Drives written for tests and the checks every replay report must pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vla_node.drives.open import DriveWriter
from vla_node.report.report import OPTIONAL_KEYS, REPORT_KEYS, load_report


def native_drive(path: Path, frames: list[np.ndarray], fps: float = 10.0, commands: list | None = None,
                 encoding: str = "rgb8") -> Path:
    """frames at fps from stamp 0; commands: [(stamp_ns, topic, fields)]."""
    with DriveWriter(path) as writer:
        for i, rgb in enumerate(frames):
            writer.add_frame("front", i, int(i * 1e9 / fps), encoding, rgb.shape[0], rgb.shape[1], rgb.tobytes())
        for n, (stamp, topic, fields) in enumerate(commands or []):
            writer.add_message(topic, stamp, {"v": 1, "seq": n, "stamp_ns": stamp, **fields})
    return path


def check_report(report: dict, json_path: Path, html_path: Path, frames_sent: int) -> None:
    assert tuple(report) == (*REPORT_KEYS, *OPTIONAL_KEYS)
    assert load_report(json_path) == report
    assert html_path.is_file() and html_path.stat().st_size > 1000
    assert report["frames_sent"] == frames_sent
    assert report["actions"] > 0 and sum(report["status_counts"].values()) == report["actions"]
