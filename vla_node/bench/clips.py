"""The real clip the benchmarks run on: the shared freeway dashcam clip, where this machine has it."""

from __future__ import annotations

import os
from pathlib import Path

CLIP_NAME = "day_freeway_solid_white_right.mp4"
CLIP_FPS = 10.0  # the rate its frames are taken at


def drives_root() -> Path:
    """Where the shared real drives are: $VLA_NODE_DRIVES, else ../shared/data/drives beside the checkout."""
    return Path(os.environ.get("VLA_NODE_DRIVES", Path(__file__).resolve().parents[2].parent / "shared" / "data" /
                               "drives"))


def default_clip() -> Path | None:
    """The freeway clip of the shared real drives, where it is."""
    root = drives_root()
    return root / CLIP_NAME if (root / CLIP_NAME).is_file() else None


def shared_clips() -> list[Path]:
    """Every clip (mp4) of the shared real drives, by name; none where they are not."""
    root = drives_root()
    return sorted(root.glob("*.mp4")) if root.is_dir() else []
