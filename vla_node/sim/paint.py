"""What the road scenes are painted with: time-of-day palettes, vehicle colours, fog, and a vehicle's rear view.

Shared by the synthetic drive generator (drives/synthetic.py, a scripted camera) and the road simulator's camera
(camera.py, a camera on a car that drives), so that both draw the same world.
"""

from __future__ import annotations

import math

import numpy as np

# Time-of-day palettes (RGB 0-255).
PALETTES: dict[str, dict[str, tuple[float, float, float]]] = {
    "day": dict(sky_top=(60, 120, 205), sky_horizon=(185, 210, 235), hills=(85, 110, 85), grass=(85, 125, 60),
                road=(100, 100, 104), marking=(235, 235, 228), fog=(190, 205, 220), tail=(200, 40, 40)),
    "overcast": dict(sky_top=(135, 140, 150), sky_horizon=(205, 207, 212), hills=(115, 122, 120),
                     grass=(100, 115, 80), road=(118, 118, 120), marking=(225, 225, 220), fog=(200, 202, 206),
                     tail=(190, 45, 45)),
    "dusk": dict(sky_top=(55, 45, 110), sky_horizon=(245, 150, 80), hills=(55, 40, 60), grass=(60, 58, 42),
                 road=(72, 66, 72), marking=(215, 200, 180), fog=(190, 120, 90), tail=(255, 60, 50)),
    "night": dict(sky_top=(6, 8, 22), sky_horizon=(32, 32, 55), hills=(12, 12, 22), grass=(16, 22, 16),
                  road=(34, 34, 40), marking=(170, 170, 160), fog=(30, 30, 48), tail=(255, 50, 40)),
    "desert": dict(sky_top=(80, 145, 225), sky_horizon=(225, 218, 200), hills=(175, 130, 90),
                   grass=(195, 165, 115), road=(125, 112, 106), marking=(240, 225, 150), fog=(215, 205, 185),
                   tail=(210, 40, 35)),
}
PALETTE_NAMES = tuple(PALETTES)
VEHICLE_COLOURS = np.array(
    [(200, 200, 205), (25, 25, 30), (150, 20, 25), (30, 60, 140), (120, 125, 130), (230, 230, 225), (60, 90, 60)],
    dtype=np.float32,
)
BUMPER = np.array((20, 20, 22), np.float32)


def light_drift(t: float, phase: np.ndarray) -> float:
    """The scene's slow brightness drift at time t (two sines of 37 s and 13 s, phases `phase` [2]): about +-7%."""
    a, b = phase
    return 1.0 + 0.05 * math.sin(2 * math.pi * t / 37.0 + a) + 0.025 * math.sin(2 * math.pi * t / 13.0 + b)


def smoothstep(x: float) -> float:
    """0 below 0, 1 above 1, 3x^2 - 2x^3 between."""
    x = min(max(x, 0.0), 1.0)
    return x * x * (3 - 2 * x)


def jittered_palette(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Palette `name` with every colour moved by up to 8 levels per channel (scenes of one time of day differ)."""
    return {k: np.array(v, np.float32) + rng.uniform(-8, 8, 3).astype(np.float32) for k, v in PALETTES[name].items()}


def fogged(colour: np.ndarray, z: float, fog_colour: np.ndarray, fog_m: float) -> np.ndarray:
    """`colour` seen z metres away through fog of visibility scale fog_m, as uint8 RGB."""
    f = 1 - math.exp(-z / fog_m)
    return np.clip(np.rint(colour * (1 - f) + fog_colour * f), 0, 255).astype(np.uint8)


def box(out: np.ndarray, x0: float, x1: float, y0: float, y1: float, colour: np.ndarray) -> None:
    """Fill the pixel rectangle [x0, x1) x [y0, y1) (rounded, clipped to the image) with `colour`."""
    h, w = out.shape[:2]
    c0, c1 = max(int(round(x0)), 0), min(int(round(x1)), w)
    r0, r1 = max(int(round(y0)), 0), min(int(round(y1)), h)
    if c1 > c0 and r1 > r0:
        out[r0:r1, c0:c1] = colour


def draw_vehicle_rear(out: np.ndarray, col: float, top: float, bottom: float, half: float, z: float,
                      colour: np.ndarray, palette: dict[str, np.ndarray], fog_m: float, night: bool) -> None:
    """A vehicle's rear seen from behind, z metres away: body, rear window, bumper (its shadow) and two tail lamps.
    col: the screen column of its centre; top, bottom: the screen rows of its roof and of its contact with the
    road; half: its half width in pixels."""
    fog = palette["fog"]
    height = bottom - top
    box(out, col - half, col + half, top, bottom, fogged(colour * (0.5 if night else 1), z, fog, fog_m))
    box(out, col - 0.8 * half, col + 0.8 * half, top + 0.1 * height, top + 0.4 * height,
        fogged(colour * 0.35, z, fog, fog_m))  # rear window
    box(out, col - half, col + half, bottom - 0.14 * height, bottom, fogged(BUMPER, z, fog, fog_m))  # bumper / shadow
    lamp = palette["tail"] * (1.0 if night else 0.85)
    for side in (-1, 1):
        lx = col + side * 0.75 * half
        box(out, lx - 0.18 * half, lx + 0.18 * half, top + 0.5 * height, top + 0.65 * height,
            fogged(lamp, z * (0.3 if night else 1.0), fog, fog_m))
