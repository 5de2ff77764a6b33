"""The demo: a synthetic road drive through the node at 1x, with its latency report. No downloads, no footage.

    vla-node demo                  # out/demo/synthetic.mcap, out/demo/report.json, out/demo/report.html

It writes the synthetic drive (640x480 at 10 fps, sensor-like grain, a scene cut or two) as a native drive,
then replays it through a node started from launch/cpu.toml (the small model on the CPU) exactly as
`vla-node replay` does, and says where the report is. About a minute on a 2-core laptop, most of it the
model's warm-up and the drive's own length.
"""

from __future__ import annotations

import os
from pathlib import Path

from vla_node.drives.convert import convert_synthetic
from vla_node.drives.replay import replay
from vla_node.drives.synthetic import SyntheticDriveConfig
from vla_node.validate import is_number, require

DEMO_SECONDS = 20.0
DEMO_SIZE = (640, 480)  # width, height
DEMO_FPS = 10.0
DEMO_NOISE_STD = 2.0  # grey levels of sensor grain: unchanged patches differ slightly frame to frame


def demo(
    out_dir: os.PathLike | str = "out/demo",
    seconds: float = DEMO_SECONDS,
    launch: os.PathLike | str | None = None,
    *,
    progress: bool = True,
) -> tuple[dict, Path, Path]:
    """Generate the synthetic drive into out_dir, replay it at 1x through a node started from `launch`
    (default launch/cpu.toml) and write the report there. Returns (report, json_path, html_path)."""
    require(is_number(seconds, finite=False) and 0 < seconds <= 3600,
            "seconds", seconds, "a number of seconds in (0, 3600]")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drive = out / "synthetic.mcap"
    config = SyntheticDriveConfig(width=DEMO_SIZE[0], height=DEMO_SIZE[1], fps=DEMO_FPS, seconds=float(seconds),
                                  noise_std=DEMO_NOISE_STD)
    summary = convert_synthetic(config, drive, progress=progress)
    print(f"demo: wrote the synthetic drive {drive} ({summary.frames} frames, {DEMO_SIZE[0]}x{DEMO_SIZE[1]} at "
          f"{DEMO_FPS:g} fps, {summary.bytes / 1e6:.1f} MB)", flush=True)
    report, json_path, html_path = replay(drive, launch, out_dir=out, progress=progress)
    print(f"demo: done. Open {html_path} in a browser for the plots; {json_path} holds the figures "
          f"(compare two runs with `vla-node report compare A.json B.json`).", flush=True)
    return report, json_path, html_path


# ---- command line (wired by cli.py) --------------------------------------------------------------------
