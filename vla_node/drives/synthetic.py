"""A deterministic synthetic forward-camera drive: road frames for demos and tests without real footage.

Pinhole camera at `CAMERA_HEIGHT_M` over a flat road that curves with constant curvature per scene. Each
scene (a stretch between hard cuts, every 8-12 s) fixes a palette (time of day), curvature, horizon, lane
count and textures; it renders its static part once (sky gradient, treeline, roadside, road, solid edge
lines, distance fog). Each frame copies that background and draws what moves: dashed lane markings and
roadside posts that flow toward the camera at `speed_mps`, vehicles that approach or pull away and drift
sideways, then applies slow lighting (brightness drift, a tunnel-like dim period) through a lookup table.
So most patches change little between frames, as on a dashcam, and a cut changes nearly all of them.

Everything derives from `seed` through numpy's SeedSequence: the same config gives the same frames bit for
bit, and any frame can be rendered on its own (`SyntheticDrive.render(index)`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Iterator

import numpy as np

from vla_node.sim.paint import (
    PALETTE_NAMES,
    VEHICLE_COLOURS,
    box,
    draw_vehicle_rear,
    fogged,
    jittered_palette,
    light_drift,
    smoothstep,
)
from vla_node.validate import is_int, is_number, require

NS_PER_S = 1_000_000_000
CAMERA_HEIGHT_M = 1.4
LANE_WIDTH_M = 3.6
DASH_PERIOD_M = 12.0
DASH_LENGTH_M = 3.0
POST_SPACING_M = 40.0
MAX_GROUND_DISTANCE_M = 400.0
CUT_SPACING_S = (8.0, 12.0)
NOISE_VARIANTS = 4
POST_COLOUR = np.array((225, 225, 215), np.float32)

@dataclasses.dataclass(frozen=True)
class SyntheticDriveConfig:
    """Size, rate, length and seed of a synthetic drive.

    speed_mps: how fast the markings and posts flow toward the camera. noise_std: sensor-like grain on the
    static scene in grey levels (0 = none): four noisy copies cycled frame by frame, so unchanged patches
    still differ slightly between frames, as on a real camera."""

    width: int = 640
    height: int = 480
    fps: float = 20.0
    seconds: float = 30.0
    seed: int = 0
    speed_mps: float = 25.0
    noise_std: float = 0.0

    def __post_init__(self) -> None:
        for key in ("width", "height"):
            v = getattr(self, key)
            require(is_int(v) and 32 <= v <= 8192, key, v,
                    "an integer in 32..8192")
        require(is_number(self.fps, finite=False) and 0 < self.fps <= 240,
                "fps", self.fps, "a number in (0, 240]")
        require(is_number(self.seconds, finite=False)
                and 0 < self.seconds <= 24 * 3600, "seconds", self.seconds, "a number in (0, 86400]")
        require(is_int(self.seed) and self.seed >= 0, "seed",
                self.seed, "a non-negative integer")
        require(is_number(self.speed_mps, finite=False)
                and 0 <= self.speed_mps <= 80, "speed_mps", self.speed_mps, "a number in [0, 80] (m/s)")
        require(is_number(self.noise_std, finite=False)
                and 0 <= self.noise_std <= 20, "noise_std", self.noise_std, "a number in [0, 20] (grey levels)")

    @property
    def frame_count(self) -> int:
        return max(1, round(self.seconds * self.fps))


@dataclasses.dataclass(frozen=True)
class _Vehicle:
    lane_x_m: float  # lateral centre of its lane, metres right of the ego lane centre
    mode: str  # "approach" (we overtake it), "recede" (it pulls away), "lead" (ahead in our lane)
    period_s: float
    phase: float
    width_m: float
    height_m: float
    colour: np.ndarray  # (3,) float32
    drift_m: float
    drift_period_s: float


class _Scene:
    """One stretch between cuts: the static background and what moves over it."""

    def __init__(self, config: SyntheticDriveConfig, index: int, palette_name: str, start_frame: int) -> None:
        rng = np.random.default_rng([config.seed, 1, index])
        w, h = config.width, config.height
        self.start_frame = start_frame
        self.palette_name = palette_name
        pal = jittered_palette(palette_name, rng)
        self.palette = pal
        self.focal = 0.75 * w
        # alternate horizon band and bend direction so that consecutive scenes always differ in geometry
        self.horizon = h * (rng.uniform(0.40, 0.44) if index % 2 == 0 else rng.uniform(0.46, 0.50))
        self.curvature = (1 if index % 2 == 0 else -1) * rng.uniform(0.0005, 0.0025)
        lanes = int(rng.integers(2, 5))
        ego_lane = int(rng.integers(0, lanes))
        self.road_left_m = -(ego_lane + 0.5) * LANE_WIDTH_M
        self.road_right_m = self.road_left_m + lanes * LANE_WIDTH_M
        self.boundaries_m = self.road_left_m + LANE_WIDTH_M * np.arange(1, lanes, dtype=np.float64)
        self.fog_m = rng.uniform(180, 400) if palette_name != "night" else 120.0
        self.brightness_phase = rng.uniform(0, 2 * math.pi, 2)
        self.tunnel = None  # (start_s, length_s) in scene time
        if rng.random() < 0.6:
            self.tunnel = (rng.uniform(0.5, 2.5), rng.uniform(4.5, 7.0))

        cols = np.arange(w, dtype=np.float64)
        rows = np.arange(h, dtype=np.float64) + 0.5
        ground = rows > self.horizon + 0.5
        self.ground_rows = np.nonzero(ground)[0]  # (G,)
        z = self.focal * CAMERA_HEIGHT_M / (rows[ground] - self.horizon)  # (G,) metres to each ground row
        self.row_z = z
        self.row_centre = w / 2 + self.focal * self.curvature * z  # (G,) screen x of the ego lane centre
        fog = (1 - np.exp(-z / self.fog_m)).astype(np.float32)[:, None]  # (G, 1)
        self.row_marking = pal["marking"] * (1 - fog) + pal["fog"] * fog  # (G, 3)
        self.row_visible = z < 120.0  # dashes beyond this melt into the fog

        background = np.empty((h, w, 3), np.float32)
        sky_t = np.clip(rows[~ground] / max(self.horizon, 1.0), 0, 1).astype(np.float32)[:, None, None]
        background[~ground] = pal["sky_top"] * (1 - sky_t) + pal["sky_horizon"] * sky_t
        # treeline / hills: a smooth silhouette just above the horizon
        ridge = np.zeros(w)
        for k in range(4):
            freq = rng.uniform(1, 6) * (k + 1)
            ridge += rng.uniform(0.2, 1.0) / (k + 1) * np.sin(2 * math.pi * freq * cols / w + rng.uniform(0, 6.3))
        ridge = self.horizon - h * (0.025 + 0.02 * (ridge - ridge.min()) / max(np.ptp(ridge), 1e-6))  # (W,)
        hill_mask = (rows[:, None] >= ridge[None, :]) & ~ground[:, None]  # (H, W)
        background[hill_mask] = pal["hills"]

        texture = rng.normal(0, 1, (len(z), w)).astype(np.float32)  # (G, W) static grain
        left = self.row_centre[:, None] + self.focal * self.road_left_m / z[:, None]  # (G, 1)
        right = self.row_centre[:, None] + self.focal * self.road_right_m / z[:, None]  # (G, 1)
        on_road = (cols[None, :] >= left) & (cols[None, :] < right)  # (G, W)
        ground_rgb = np.where(on_road[..., None], pal["road"], pal["grass"])  # (G, W, 3)
        ground_rgb = ground_rgb + np.where(on_road, 4.0, 9.0)[..., None] * texture[..., None]
        edge = 0.15 * self.focal / z[:, None]  # (G, 1) edge line width in pixels
        edge_line = on_road & ((cols[None, :] < left + edge) | (cols[None, :] >= right - edge))
        ground_rgb[edge_line] = np.broadcast_to(self.row_marking[:, None, :], ground_rgb.shape)[edge_line]
        ground_rgb = ground_rgb * (1 - fog[..., None]) + pal["fog"] * fog[..., None]
        ground_rgb[z >= MAX_GROUND_DISTANCE_M] = pal["fog"]
        background[ground] = ground_rgb
        # sensor grain lives in a few pre-noised copies of the background, cycled frame by frame (free per frame)
        if config.noise_std > 0:
            grain = rng.normal(0, config.noise_std, (NOISE_VARIANTS, h, w, 1)).astype(np.float32)  # (K, H, W, 1)
            variants = background[None] + grain  # (K, H, W, 3)
        else:
            variants = background[None]  # (1, H, W, 3)
        self.backgrounds = np.clip(np.rint(variants), 0, 255).astype(np.uint8)

        self.vehicles = self._make_vehicles(rng, lanes, ego_lane)
        self._cols = np.arange(w)

    def _make_vehicles(self, rng: np.random.Generator, lanes: int, ego_lane: int) -> list[_Vehicle]:
        vehicles = []
        lane_xs = [self.road_left_m + (i + 0.5) * LANE_WIDTH_M for i in range(lanes)]
        others = [x for i, x in enumerate(lane_xs) if i != ego_lane]
        count = int(rng.integers(3, 7))
        for k in range(count):
            if k == 0 and rng.random() < 0.7:
                mode, lane_x = "lead", 0.0
            else:
                mode = "approach" if rng.random() < 0.55 else "recede"
                lane_x = float(others[int(rng.integers(0, len(others)))])
            truck = rng.random() < 0.15
            vehicles.append(_Vehicle(
                lane_x_m=lane_x,
                mode=mode,
                period_s=float(rng.uniform(8, 14) if mode == "lead" else rng.uniform(15, 35)),  # 4-10 m/s closing
                phase=float(rng.uniform(0, 1)),
                width_m=float(rng.uniform(2.4, 2.6) if truck else rng.uniform(1.7, 2.0)),
                height_m=float(rng.uniform(3.0, 3.8) if truck else rng.uniform(1.3, 1.7)),
                colour=VEHICLE_COLOURS[int(rng.integers(0, len(VEHICLE_COLOURS)))],
                drift_m=float(rng.uniform(0.1, 0.5)),
                drift_period_s=float(rng.uniform(4, 10)),
            ))
        return vehicles

    # ---- per frame ---------------------------------------------------------------------------------

    def gain(self, t: float) -> float:
        """Global brightness: slow drift times a smooth dip while in a tunnel."""
        g = light_drift(t, self.brightness_phase)
        if self.tunnel is not None:
            start, length = self.tunnel
            ramp = 2.0  # seconds from the portal coming into view to full exposure adaptation, each end
            g *= 1.0 - 0.55 * smoothstep(min(t - start, start + length - t) / ramp)
        return g

    def draw_dashes(self, out: np.ndarray, travelled_m: float) -> None:
        on = self.row_visible & (((self.row_z + travelled_m) % DASH_PERIOD_M) < DASH_LENGTH_M)  # (G,)
        if not on.any():
            return
        z = self.row_z[on][:, None]  # (R, 1)
        centre = self.row_centre[on][:, None]  # (R, 1)
        half = np.maximum(0.06 * self.focal / z, 0.5)  # (R, 1)
        x = centre + self.focal * self.boundaries_m[None, :] / z  # (R, B)
        x0 = np.rint(x - half).astype(np.int64)[:, :, None]  # (R, B, 1)
        x1 = np.maximum(np.rint(x + half).astype(np.int64), x0[..., 0] + 1)[:, :, None]  # (R, B, 1)
        mask = ((self._cols >= x0) & (self._cols < x1)).any(axis=1)  # (R, W)
        rr, cc = np.nonzero(mask)
        out[self.ground_rows[on][rr], cc] = np.rint(self.row_marking[on][rr]).astype(np.uint8)

    def _screen(self, z: float, x_m: float) -> tuple[float, float]:
        """(column, bottom row) of a ground point z metres ahead, x metres right of the ego lane centre."""
        column = self.backgrounds.shape[2] / 2 + self.focal * (self.curvature * z + x_m / z)
        return column, self.horizon + self.focal * CAMERA_HEIGHT_M / z

    def draw_posts(self, out: np.ndarray, travelled_m: float) -> None:
        offset = travelled_m % POST_SPACING_M
        for j in range(int(250 / POST_SPACING_M), 0, -1):  # far to near
            z = j * POST_SPACING_M - offset
            if z < 2.0:
                continue
            for side_m in (self.road_left_m - 1.2, self.road_right_m + 1.2):
                col, bottom = self._screen(z, side_m)
                half = max(0.06 * self.focal / z, 0.5)
                box(out, col - half, col + half, bottom - self.focal * 1.0 / z, bottom,
                    fogged(POST_COLOUR, z, self.palette["fog"], self.fog_m))

    def draw_vehicles(self, out: np.ndarray, t: float) -> None:
        placed = []
        for v in self.vehicles:
            frac = (t / v.period_s + v.phase) % 1.0
            if v.mode == "approach":
                z = 150.0 - 148.0 * frac
            elif v.mode == "recede":
                z = 2.0 + 148.0 * frac
            else:
                z = 22.0 + 10.0 * math.sin(2 * math.pi * frac)
            x = v.lane_x_m + v.drift_m * math.sin(2 * math.pi * t / v.drift_period_s + 7 * v.phase)
            placed.append((z, x, v))
        placed.sort(key=lambda p: -p[0])  # painter's order: far first
        night = self.palette_name == "night"
        for z, x, v in placed:
            col, bottom = self._screen(z, x)
            half = self.focal * v.width_m / 2 / z
            draw_vehicle_rear(out, col, bottom - self.focal * v.height_m / z, bottom, half, z, v.colour,
                              self.palette, self.fog_m, night)


class SyntheticDrive:
    """Random access to the frames of one synthetic drive; scenes are built on first use and cached."""

    def __init__(self, config: SyntheticDriveConfig) -> None:
        self.config = config
        self.frame_count = config.frame_count
        self.scene_cut_indices = _cut_indices(config)
        self._scenes: dict[int, _Scene] = {}
        self._palettes = _palette_sequence(config, len(self.scene_cut_indices) + 1)
        self._lut = np.arange(256, dtype=np.float32)

    def stamp_ns(self, index: int) -> int:
        return round(index * NS_PER_S / self.config.fps)

    def _scene(self, index: int) -> _Scene:
        k = bisect.bisect_right(self.scene_cut_indices, index)
        scene = self._scenes.get(k)
        if scene is None:
            start = self.scene_cut_indices[k - 1] if k > 0 else 0
            self._scenes = {k: _Scene(self.config, k, self._palettes[k], start)}  # keep one scene alive
            scene = self._scenes[k]
        return scene

    def render(self, index: int) -> np.ndarray:
        """Frame `index` as a new HxWx3 uint8 RGB array."""
        if not 0 <= index < self.frame_count:
            raise IndexError(f"frame index {index} outside 0..{self.frame_count - 1}")
        scene = self._scene(index)
        t = (index - scene.start_frame) / self.config.fps  # seconds since the scene began
        travelled = self.config.speed_mps * index / self.config.fps
        out = scene.backgrounds[index % len(scene.backgrounds)].copy()
        scene.draw_dashes(out, travelled)
        scene.draw_posts(out, travelled)
        scene.draw_vehicles(out, t)
        lut = np.clip(np.rint(self._lut * scene.gain(t)), 0, 255).astype(np.uint8)
        return lut[out]

    def frames(self) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(self.frame_count):
            yield self.stamp_ns(i), self.render(i)


def _cut_indices(config: SyntheticDriveConfig) -> tuple[int, ...]:
    rng = np.random.default_rng([config.seed, 0])
    cuts = []
    t = rng.uniform(*CUT_SPACING_S)
    while True:
        index = math.ceil(t * config.fps - 1e-9)
        if index >= config.frame_count:
            return tuple(cuts)
        if not cuts or index > cuts[-1]:
            cuts.append(index)
        t += rng.uniform(*CUT_SPACING_S)


def _palette_sequence(config: SyntheticDriveConfig, scenes: int) -> list[str]:
    rng = np.random.default_rng([config.seed, 3])
    names = [PALETTE_NAMES[int(rng.integers(0, len(PALETTE_NAMES)))]]
    for _ in range(scenes - 1):
        choices = [n for n in PALETTE_NAMES if n != names[-1]]
        names.append(choices[int(rng.integers(0, len(choices)))])
    return names


def synthetic_frames(config: SyntheticDriveConfig) -> Iterator[tuple[int, np.ndarray]]:
    """(stamp_ns, rgb HxWx3 uint8) for every frame, stamps k * 1e9 / fps from 0."""
    return SyntheticDrive(config).frames()


def scene_cut_indices(config: SyntheticDriveConfig) -> tuple[int, ...]:
    """Indices of the frames that start a new scene (a hard cut from the frame before)."""
    return _cut_indices(config)
