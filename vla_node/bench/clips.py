"""The real clip the benchmarks run on: the shared freeway dashcam clip, where this machine has it."""

from __future__ import annotations

import os
from pathlib import Path

CLIP_NAME = "day_freeway_solid_white_right.mp4"
CLIP_FPS = 10.0  # the rate its frames are taken at


def default_clip() -> Path | None:
    """The freeway clip of the shared real drives ($VLA_NODE_DRIVES, else ../shared/data/drives beside the
    checkout), where it is."""
    root = Path(os.environ.get("VLA_NODE_DRIVES", Path(__file__).resolve().parents[2].parent / "shared" / "data" /
                               "drives"))
    return root / CLIP_NAME if (root / CLIP_NAME).is_file() else None
