"""The ego's forward camera: renders what a pinhole camera on the car sees of the road, its scenery and the traffic.

A level pinhole camera `height_m` over the road, `forward_m` ahead of the rear axle, looking along the car's
heading (so a heading error or a lateral offset moves the whole road on screen, as on a dashcam). Per frame:

1. Stations ahead of the car are sampled every metre and taken into the camera frame (forward, right). Each ground
   row of the image sees the road at one forward distance z (fixed by the row: no pitch), so per row the road's
   reference line is at right = interp(z) and the station at s = interp(z) (only the stretch where forward
   distance still grows is used: a road bending back out of view is cut there).
2. Every ground pixel gets its lateral road offset d from its column; from d and s: road or grass, a world-anchored
   grain (the road surface moves under the car), tree shadows from the scenery's shadow map, the lane lines (solid
   edges, dashed inner lines; each blended by its coverage of the pixel, so distant lines fade instead of
   flickering) and distance fog.
3. The sky is a gradient over a hill silhouette that depends on the compass direction, so the car's yaw turns it.
4. Vehicles are drawn far to near as rear views (paint.py); then the scene's light (a slow drift and the darker
   stretches of underpasses) scales every pixel. At night the car's low beams light the road near and ahead.

Scenery (palette, fog, shadow and grain maps, hills, underpasses) is made once per drive from its seed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from vla_node.sim.paint import PALETTE_NAMES, draw_vehicle_rear, jittered_palette, light_drift, smoothstep
from vla_node.sim.road import Road
from vla_node.sim.traffic import Vehicle
from vla_node.sim.vehicle import VehicleState
from vla_node.validate import is_int, is_number, require

MAP_DS, MAP_DD = 0.5, 0.25  # shadow map cell (m along the road, m across)
MAP_MARGIN_M = 14.0  # the shadow map covers the road and this much beyond each edge
GRAIN_CELL_M = 0.08  # grain texel
GRAIN_TILE = 256  # grain texels per side of its periodic tile
LINE_HALF_WIDTH_M = 0.1  # 20 cm lines
DASH_PERIOD_M, DASH_LENGTH_M = 12.0, 3.0
LOOK_AHEAD_M = 300.0
MARKINGS_VISIBLE_M = 150.0
HEADLIGHT_GAIN, HEADLIGHT_RANGE_M = 2.5, 30.0


@dataclasses.dataclass(frozen=True)
class CameraConfig:
    width: int = 256
    height: int = 192
    focal_scale: float = 1.0  # focal length in pixels = focal_scale x width (a 53 degree horizontal view)
    height_m: float = 1.4
    forward_m: float = 1.5  # ahead of the rear axle
    horizon: float = 0.3  # the horizon's row as a fraction of the image height (the camera looks down a little)

    def __post_init__(self) -> None:
        require(is_int(self.width) and 32 <= self.width <= 1920, "camera.width", self.width, "an integer in 32..1920")
        require(is_int(self.height) and 32 <= self.height <= 1080, "camera.height", self.height,
                "an integer in 32..1080")
        for key, lo, hi in (("focal_scale", 0.2, 3.0), ("height_m", 0.3, 5.0), ("forward_m", -5.0, 5.0),
                            ("horizon", 0.1, 0.9)):
            value = getattr(self, key)
            require(is_number(value) and lo <= value <= hi, f"camera.{key}", value, f"a number in [{lo}, {hi}]")

    @property
    def focal(self) -> float:
        return self.focal_scale * self.width


class Scenery:
    """What a drive's world looks like beyond its geometry: palette, fog, shadows, grain, hills, underpasses."""

    def __init__(self, road: Road, seed: int, palette: str | None = None) -> None:
        rng = np.random.default_rng([seed, 21])
        self.palette_name = palette if palette is not None else PALETTE_NAMES[int(rng.integers(len(PALETTE_NAMES)))]
        require(self.palette_name in PALETTE_NAMES, "scenery.palette", self.palette_name, f"one of {PALETTE_NAMES}")
        self.palette = jittered_palette(self.palette_name, rng)
        self.night = self.palette_name == "night"
        self.fog_m = 120.0 if self.night else float(rng.uniform(180, 400))
        self.s0 = float(road.s[0])
        self.d0 = road.right_edge - MAP_MARGIN_M
        rows = int(math.ceil((road.s[-1] - road.s[0]) / MAP_DS)) + 1
        cols = int(math.ceil((road.left_edge + MAP_MARGIN_M - self.d0) / MAP_DD)) + 1
        self.shadow = self._tree_shadows(rng, road, rows, cols)  # (rows, cols) float32 light factor in (0, 1]
        self.grain = rng.normal(0, 1, (GRAIN_TILE, GRAIN_TILE)).astype(np.float32)
        self.ridge_terms = [(k + 1, float(rng.uniform(0.2, 1.0)) / (k + 1), float(rng.uniform(0, 6.3)))
                            for k in range(5)]
        self.light_phase = rng.uniform(0, 2 * math.pi, 2)
        self.underpasses = []  # (start_s, end_s): the scene dims while the car is under one
        s = float(rng.uniform(150, 600))
        while s < road.s[-1]:
            length = float(rng.uniform(25, 80))
            self.underpasses.append((s, s + length))
            s += length + float(rng.uniform(500, 1400))

    def _tree_shadows(self, rng: np.random.Generator, road: Road, rows: int, cols: int) -> np.ndarray:
        """Light factor per map cell: tree crowns beside the road cast elliptic shadows across it, densely in wooded
        stretches and sparsely elsewhere (the freeway clips' tree shadows)."""
        light = np.ones((rows, cols), np.float32)
        depth = 0.55 if not self.night else 0.85
        s = float(road.s[0])
        while s < road.s[-1]:
            wooded = rng.random() < 0.4
            stretch = float(rng.uniform(100, 400))
            count = rng.poisson((stretch / 12) if wooded else (stretch / 80))
            for tree_s in rng.uniform(s, s + stretch, count):
                side = road.left_edge + rng.uniform(1.5, 6) if rng.random() < 0.5 else road.right_edge - rng.uniform(1.5, 6)
                centre_d = side + rng.uniform(-1, 1) - 0.5 * rng.uniform(2, 8) * np.sign(side)  # cast toward the road
                half_s, half_d = rng.uniform(1.5, 4.5), rng.uniform(2.0, 6.0)
                r0, r1 = int((tree_s - half_s - self.s0) / MAP_DS), int((tree_s + half_s - self.s0) / MAP_DS) + 1
                c0, c1 = int((centre_d - half_d - self.d0) / MAP_DD), int((centre_d + half_d - self.d0) / MAP_DD) + 1
                r0, r1, c0, c1 = max(r0, 0), min(r1, rows), max(c0, 0), min(c1, cols)
                if r1 <= r0 or c1 <= c0:
                    continue
                ss = (self.s0 + (np.arange(r0, r1) + 0.5) * MAP_DS - tree_s)[:, None] / half_s  # (R, 1)
                dd = (self.d0 + (np.arange(c0, c1) + 0.5) * MAP_DD - centre_d)[None, :] / half_d  # (1, C)
                inside = np.clip(1.0 - (ss * ss + dd * dd), 0, 1) ** 0.3  # soft-edged ellipse
                light[r0:r1, c0:c1] = np.minimum(light[r0:r1, c0:c1], 1 - (1 - depth) * inside)
            s += stretch
        return light

    def light(self, t: float, s: float) -> float:
        """The scene's brightness at time t with the car at station s: a slow drift, dimmed under an underpass."""
        gain = light_drift(t, self.light_phase)
        for start, end in self.underpasses:
            if start - 40 < s < end + 10:
                gain *= 1.0 - 0.5 * smoothstep(min(s - (start - 40), end + 10 - s) / 20)
        return gain


class Camera:
    def __init__(self, config: CameraConfig, road: Road, scenery: Scenery) -> None:
        self.config, self.road, self.scenery = config, road, scenery
        w, h = config.width, config.height
        self.cx = w / 2
        self.horizon = config.horizon * h
        rows = np.arange(h, dtype=np.float64) + 0.5
        ground = rows > self.horizon + 0.5
        self.ground_rows = int(np.argmax(ground))  # the first ground row; every row below it is ground too
        self.row_z = config.focal * config.height_m / (rows[ground] - self.horizon)  # (G,) metres ahead
        self.cols = (np.arange(w, dtype=np.float64) + 0.5 - self.cx) / config.focal  # (W,) right / forward
        self.pixel_m = self.row_z / config.focal  # (G,) metres a pixel spans across, at each row
        pal = scenery.palette
        self.fog = (1 - np.exp(-self.row_z / scenery.fog_m)).astype(np.float32)  # (G,)
        sky_t = np.clip(rows[~ground] / max(self.horizon, 1.0), 0, 1).astype(np.float32)[:, None]  # (S, 1)
        self.sky = (pal["sky_top"] * (1 - sky_t) + pal["sky_horizon"] * sky_t).T[:, :, None]  # (3, S, 1)
        self.sky_rows = rows[~ground]
        self.stations = np.arange(-5.0, LOOK_AHEAD_M, 1.0)  # (K,) stations sampled ahead of the car
        self.headlights = None
        if scenery.night:  # (G, W) light gain of low beams: strongest near, within about 25 degrees of the axis
            beam = np.clip(1 - np.abs(self.cols) / 0.45, 0, 1)[None, :]
            self.headlights = (1 + HEADLIGHT_GAIN * np.exp(-self.row_z / HEADLIGHT_RANGE_M)[:, None] * beam
                               ).astype(np.float32)

    def position(self, ego: VehicleState) -> tuple[float, float]:
        return (ego.x + self.config.forward_m * math.cos(ego.heading),
                ego.y + self.config.forward_m * math.sin(ego.heading))

    def render(self, ego: VehicleState, ego_s: float, vehicles: list[Vehicle], t: float) -> np.ndarray:
        """The frame (height x width x 3 uint8 RGB) at time t with the car at `ego` (station ego_s)."""
        cfg, road, scenery, pal = self.config, self.road, self.scenery, self.scenery.palette
        cam_x, cam_y = self.position(ego)
        cos_h, sin_h = math.cos(ego.heading), math.sin(ego.heading)
        stations = np.clip(ego_s + self.stations, road.s[0], road.s[-1])  # (K,)
        x, y, heading = road.pose(stations)
        forward = (x - cam_x) * cos_h + (y - cam_y) * sin_h  # (K,)
        right = (x - cam_x) * sin_h - (y - cam_y) * cos_h  # (K,)
        rising = np.concatenate([[True], np.diff(forward) > 0])
        keep = int(np.argmin(rising)) if not rising.all() else len(forward)  # the stretch where forward still grows
        forward, right, stations, across = forward[:keep], right[:keep], stations[:keep], np.cos(heading[:keep] - ego.heading)
        z = self.row_z
        seen = z <= forward[-1]  # (G,) rows that see the road stretch (beyond: fog)
        ref_right = np.interp(z, forward, right)  # (G,) where the reference line is, metres right
        row_s = np.interp(z, forward, stations)  # (G,)
        row_across = np.maximum(np.interp(z, forward, across), 0.2)  # (G,) cos(road heading - car heading)
        # lateral offset d of every ground pixel: right = ref_right - d * cos(angle)
        d = ((ref_right[:, None] - self.cols[None, :] * z[:, None]) / row_across[:, None]).astype(np.float32)  # (G, W)
        pixel_d = (self.pixel_m / row_across).astype(np.float32)[:, None]  # (G, 1) metres of d a pixel spans
        on_road = ((d <= road.left_edge) & (d >= road.right_edge)).astype(np.float32)  # (G, W)
        gi = np.floor(row_s / GRAIN_CELL_M).astype(np.int32)[:, None] & (GRAIN_TILE - 1)
        gj = np.floor(d * (1 / GRAIN_CELL_M)).astype(np.int32) & (GRAIN_TILE - 1)
        grain = (9.0 - 5.0 * on_road) * scenery.grain[gi, gj]  # (G, W) grey levels, finer on the road
        rows, cols = scenery.shadow.shape
        si = np.clip(((row_s - scenery.s0) / MAP_DS).astype(np.int32), 0, rows - 1)[:, None]
        sj = np.clip(((d - scenery.d0) * (1 / MAP_DD)).astype(np.int32), 0, cols - 1)
        cover = self._line_cover(d, pixel_d, row_s, z)  # (G, W) fraction of each pixel that is painted line
        clear = ((1 - self.fog) * seen)[:, None].astype(np.float32)  # (G, 1) what fog leaves of the surface
        surface = scenery.shadow[si, sj] * (1 - cover) * clear  # (G, W) weight of the shaded, grained surface
        paint = cover * clear  # (G, W) weight of the lines
        if self.headlights is not None:  # at night the car's own beams light the road ahead
            surface = surface * self.headlights
            paint = paint * self.headlights
        fogged = 1 - clear
        # per channel, in planes (a trailing channel axis makes numpy's inner loops 3 long): (road or grass +
        # grain) x shade, the lines over it, fog over both
        planes = np.empty((3, cfg.height, cfg.width), np.float32)
        for c in range(3):
            grass, road_c = pal["grass"][c], pal["road"][c]
            planes[c, self.ground_rows:] = (surface * (grass + (road_c - grass) * on_road + grain)
                                            + paint * pal["marking"][c] + fogged * pal["fog"][c])
        planes[:, : self.ground_rows] = self._sky(ego.heading)
        frame = np.ascontiguousarray((np.clip(planes, 0, 255) + 0.5).astype(np.uint8).transpose(1, 2, 0))
        self._vehicles(frame, cam_x, cam_y, cos_h, sin_h, vehicles, t)
        gain = scenery.light(t, ego_s)
        if gain != 1.0:
            lut = np.clip(np.rint(np.arange(256, dtype=np.float32) * gain), 0, 255).astype(np.uint8)
            frame = lut[frame]
        return frame

    def _line_cover(self, d: np.ndarray, pixel_d: np.ndarray, row_s: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Coverage in [0, 1] of each pixel by its nearest lane line: the overlap of [line - w, line + w] with the
        pixel's span [d - p/2, d + p/2], over p (lines are a lane width apart: a pixel meets at most one). The edges
        are solid, the lines between lanes dashed (by station)."""
        road = self.road
        k = np.clip(np.rint((road.left_edge - d) * (1 / road.lane_width)), 0, road.lanes)  # (G, W) nearest line
        line = road.left_edge - road.lane_width * k
        half = pixel_d / 2
        overlap = np.minimum(d + half, line + LINE_HALF_WIDTH_M) - np.maximum(d - half, line - LINE_HALF_WIDTH_M)
        cover = np.clip(overlap / pixel_d, 0, 1)
        dashed_off = ~(((row_s % DASH_PERIOD_M) < DASH_LENGTH_M) & (z < MARKINGS_VISIBLE_M))  # (G,)
        cover[dashed_off[:, None] & (k > 0) & (k < road.lanes)] = 0
        return cover

    def _sky(self, heading: float) -> np.ndarray:
        """Sky rows as planes (3, S, W): the gradient, and hills whose silhouette follows the compass direction each
        column looks along."""
        cfg, scenery = self.config, self.scenery
        azimuth = heading - np.arctan(self.cols)  # (W,) left columns look along larger angles
        ridge = np.zeros_like(azimuth)
        for freq, amp, phase in scenery.ridge_terms:
            ridge += amp * np.sin(freq * 2 * azimuth + phase)
        ridge = self.horizon - cfg.height * (0.03 + 0.012 * ridge)  # (W,) the hills' top row
        hills = self.sky_rows[:, None] >= ridge[None, :]  # (S, W)
        return np.where(hills[None], scenery.palette["hills"][:, None, None], self.sky)

    def _vehicles(self, frame: np.ndarray, cam_x: float, cam_y: float, cos_h: float, sin_h: float,
                  vehicles: list[Vehicle], t: float) -> None:
        cfg, road, scenery = self.config, self.road, self.scenery
        placed = []
        for v in vehicles:
            rear = v.station(t) - v.length_m / 2
            if not (road.s[0] <= rear <= road.s[-1]):
                continue
            x, y, _ = road.pose(rear, v.offset(road, t))
            z = (x - cam_x) * cos_h + (y - cam_y) * sin_h
            if 2.0 <= z <= 250.0:
                placed.append((z, (x - cam_x) * sin_h - (y - cam_y) * cos_h, v))
        placed.sort(key=lambda p: -p[0])  # painter's order: far first
        for z, right, v in placed:
            col = self.cx + cfg.focal * right / z
            bottom = self.horizon + cfg.focal * cfg.height_m / z
            draw_vehicle_rear(frame, col, bottom - cfg.focal * v.height_m / z, bottom, cfg.focal * v.width_m / 2 / z,
                              z, v.colour, scenery.palette, scenery.fog_m, scenery.night)
