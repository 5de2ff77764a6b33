"""`vla-node bench soak`'s figures: pure functions of what the client sent and read (no sockets, no clock).

    parse_camera     'NAME=WxH@FPS' -> SoakCamera (the --camera flag)
    rss_figures      RSS over time from the health messages' rss_bytes; growth after warm-up
    reconcile        frames sent by the client against the node's per-camera counters (and states against commands)
    targets / table  met or missed, and the compact table printed at the end
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from vla_node.validate import ConfigError

TARGETS = {"rss_growth_pct": 5.0, "missed_ticks": 0, "control_jitter_ms_p99": 2.0, "reconciled": True}
WARMUP_FRACTION, WARMUP_MIN_S = 0.2, 10.0
RSS_WINDOW = 5  # health samples (at most) whose median is the RSS at the start and at the end of the measured part
_CAMERA = re.compile(r"([A-Za-z0-9_.-]{1,64})=(\d+)x(\d+)@(\d+(?:\.\d*)?)")
CAMERA_FORM = "NAME=WxH@FPS, e.g. front=1920x1080@30 (W, H in 32..8192, FPS in (0, 240])"


@dataclass(frozen=True)
class SoakCamera:
    name: str
    width: int
    height: int
    fps: float

    @property
    def spec(self) -> str:
        return f"{self.name}={self.width}x{self.height}@{self.fps:g}"


def parse_camera(text: str) -> SoakCamera:
    """'front=1920x1080@30' -> SoakCamera; ConfigError naming the spec and the expected form otherwise."""
    m = _CAMERA.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"--camera {text!r}: expected {CAMERA_FORM}")
    camera = SoakCamera(m[1], int(m[2]), int(m[3]), float(m[4]))
    if not (32 <= camera.width <= 8192 and 32 <= camera.height <= 8192 and 0 < camera.fps <= 240):
        raise ConfigError(f"--camera {text!r}: expected {CAMERA_FORM}")
    return camera


def parse_cameras(texts: Sequence[str]) -> tuple[SoakCamera, ...]:
    cameras = tuple(parse_camera(t) for t in texts)
    names = [c.name for c in cameras]
    if not cameras or len(set(names)) != len(names):
        raise ConfigError(f"--camera {list(texts)}: expected one or more cameras with distinct names ({CAMERA_FORM})")
    return cameras


def warmup_s(run_s: float) -> float:
    """The first 20% of the run or its first 10 s, whichever is longer."""
    return max(WARMUP_FRACTION * run_s, WARMUP_MIN_S)


# --- RSS ----------------------------------------------------------------------------------------------------------
def rss_figures(samples: Sequence[tuple[int, int]], start_ns: int, warmup_ns: int) -> dict[str, Any]:
    """samples: (stamp_ns, rss_bytes) of every health message, oldest first. Growth after warm-up compares the median
    of the last RSS_WINDOW samples with that of the first RSS_WINDOW after warm-up (a frame or two in flight moves
    one sample by megabytes); peak_growth_pct the highest sample after warm-up with the same start. None where fewer
    than two samples follow the warm-up."""
    t = np.asarray([s[0] for s in samples], np.int64)
    rss = np.asarray([s[1] for s in samples], np.float64) / 2**20  # MB
    series = [[round((ti - start_ns) / 1e9, 3), round(float(r), 2)] for ti, r in zip(t, rss)]
    out: dict[str, Any] = {"samples": int(rss.size), "warmup_s": round(warmup_ns / 1e9, 3), "series_s_mb": series,
                           "first_mb": None, "max_mb": None, "start_mb": None, "end_mb": None, "growth_pct": None,
                           "peak_growth_pct": None, "slope_mb_per_min": None}
    if rss.size:
        out.update(first_mb=round(float(rss[0]), 2), max_mb=round(float(rss.max()), 2))
    after = t >= start_ns + warmup_ns
    if after.sum() < 2:
        return out
    ta, ra = t[after], rss[after]
    k = max(1, min(RSS_WINDOW, ra.size // 4))
    start_mb, end_mb = float(np.median(ra[:k])), float(np.median(ra[-k:]))
    slope = np.polyfit((ta - ta[0]) / 60e9, ra, 1)[0] if ta[-1] > ta[0] else 0.0  # MB per minute
    out.update(start_mb=round(start_mb, 2), end_mb=round(end_mb, 2),
               growth_pct=round((end_mb - start_mb) / start_mb * 100, 3),
               peak_growth_pct=round((float(ra.max()) - start_mb) / start_mb * 100, 3),
               slope_mb_per_min=round(float(slope), 3))
    return out


def missed_ticks(ticks: Mapping[str, Any], node_missed: int) -> int:
    """Ticks the client never saw: seq gaps (published, lost) + ticks the node skipped, from its health counter or
    from the grid gaps in the stamps, whichever says more (both count the same skipped ticks)."""
    return int(ticks["lost"]) + max(int(node_missed), int(ticks["skipped"]))


# --- counters -----------------------------------------------------------------------------------------------------
def reconcile(sent: Mapping[str, int], states_sent: int, health: Mapping[str, Any],
              states_unsent: int = 0) -> dict[str, Any]:
    """sent: frames the client sent per camera (sends the socket refused are not in it); states_sent likewise;
    health: the node's settled health message after the run (cumulative counters since it started); states_unsent:
    state sends the socket refused (each skips a seq: where health counts commands_lost, they must agree).

    Per camera received = processed + dropped + pending, pending 0 or 1 (a camera's newest frame not yet taken);
    received <= sent. The node counts rejects by reason node-wide, not per camera, so the rest reconciles in total:
    sent - received (frames) + states sent - commands accepted = rejected + discarded in a burst of bad messages."""
    mismatches: list[str] = []
    node_cameras = health.get("cameras", {})
    cameras: dict[str, Any] = {}
    gap = 0
    for name, n_sent in sent.items():
        cam = node_cameras.get(name)
        if cam is None:
            mismatches.append(f"{name}: not in the node's health (cameras {sorted(node_cameras)})")
            continue
        received, processed, dropped = cam["received"], cam["processed"], cam["dropped"]
        pending = received - processed - dropped
        cameras[name] = {"sent": n_sent, "received": received, "processed": processed, "dropped": dropped,
                         "pending": pending}
        if pending not in (0, 1):
            mismatches.append(f"{name}: received {received} != processed {processed} + dropped {dropped} "
                              f"(+ pending <= 1): {pending:+d}")
        if received > n_sent:
            mismatches.append(f"{name}: the node received {received} frames, the client sent {n_sent}")
        gap += n_sent - received
    extra = sorted(set(node_cameras) - set(sent))
    if extra:
        mismatches.append(f"the node counts cameras the client never sent: {extra}")
    rejects = dict(health.get("rejects", {}))
    rejected = int(health.get("rejected", sum(rejects.values())))
    discarded = int(health.get("drops", {}).get("discarded_in_bad_burst", 0))
    accepted = int(health.get("commands", 0))
    unexplained = gap + (states_sent - accepted) - rejected - discarded
    lost = health.get("commands_lost", {}).get("state")
    if lost is not None and lost != states_unsent:
        mismatches.append(f"the node counts {lost} states lost on the way (seq gaps), the client {states_unsent} "
                          "refused at send")
    if unexplained:
        mismatches.append(f"sent {sum(sent.values())} frames + {states_sent} states, the node received "
                          f"{sum(c['received'] for c in cameras.values())} frames + accepted {accepted} commands, "
                          f"rejected {rejected} {rejects}, discarded {discarded}: {unexplained:+d} unaccounted")
    return {"reconciled": not mismatches, "mismatches": mismatches, "cameras": cameras,
            "commands": {"states_sent": states_sent, "states_unsent": states_unsent, "accepted": accepted,
                         "lost_by_node": lost}, "rejected": rejected,
            "rejects": rejects, "discarded_in_bad_burst": discarded}


# --- targets and table --------------------------------------------------------------------------------------------
def targets_met(result: Mapping[str, Any]) -> dict[str, bool | None]:
    """Each target met (True), missed (False) or not measured (None: no RSS samples after warm-up, no ticks). RSS:
    the node's, and its publisher process's where health reports one."""
    rss = [result[k]["growth_pct"] for k in ("rss", "publisher_rss") if k in result]
    p99 = result["control_jitter_ms"]["p99"]
    return {"rss_growth_pct": None if None in rss else all(g < TARGETS["rss_growth_pct"] for g in rss),
            "missed_ticks": result["missed_ticks"] <= TARGETS["missed_ticks"],
            "control_jitter_ms_p99": None if math.isnan(p99) else p99 <= TARGETS["control_jitter_ms_p99"],
            "reconciled": result["counters"]["reconciled"]}


def table(result: Mapping[str, Any]) -> str:
    ok = {True: "ok", False: "MISS", None: "n/a"}
    met, rss, j, t, c = (result["pass"], result["rss"], result["control_jitter_ms"], result["ticks"],
                         result["counters"])
    ctx = result["context"]
    lines = [f"soak {ctx['seconds']:g} s, {', '.join(ctx['cameras'])} ({ctx['encoding']}), control "
             f"{ctx['control_hz']:g} Hz, {ctx['model']}, warm-up {rss['warmup_s']:g} s, node exit code "
             f"{ctx.get('exit_code')}, load {ctx['loadavg_before']} -> {ctx['loadavg_after']}",
             f"{'figure':<28}{'value':>30}  {'target':<12}"]

    def row(name: str, value: str, target: str = "", key: str | None = None) -> None:
        lines.append(f"{name:<28}{value:>30}  {target:<12}{'' if key is None else ok[met[key]]}")

    row("rss_mb start/end/max", f"{rss['start_mb']}/{rss['end_mb']}/{rss['max_mb']}")
    row("rss_growth_pct (peak)", f"{rss['growth_pct']} ({rss['peak_growth_pct']})", "< 5", "rss_growth_pct")
    if "publisher_rss" in result:
        pub = result["publisher_rss"]
        row("publisher rss_mb, growth_pct", f"{pub['end_mb']}, {pub['growth_pct']}", "< 5")
    row("missed_ticks", f"{result['missed_ticks']} (gaps {t['lost_seq_gaps']}, node {t['node_missed_ticks']})",
        "0", "missed_ticks")
    row("control_jitter_ms p50/p99/max", f"{j['p50']}/{j['p99']}/{j['max']}", "p99 <= 2", "control_jitter_ms_p99")
    row("counters reconcile", str(c["reconciled"]), "true", "reconciled")
    lines.append(f"{'camera':<12}{'sent':>8}{'unsent':>8}{'late':>7}{'received':>10}{'processed':>10}{'dropped':>9}"
                 f"{'pending':>9}")
    for name, cam in c["cameras"].items():
        client = result["client"]["cameras"][name]
        lines.append(f"{name:<12}{cam['sent']:>8}{client['unsent']:>8}{client['late']:>7}{cam['received']:>10}"
                     f"{cam['processed']:>10}{cam['dropped']:>9}{cam['pending']:>9}")
    lines.append(f"states sent {c['commands']['states_sent']}, commands accepted {c['commands']['accepted']}; "
                 f"rejects {c['rejects'] or 'none'}; statuses {result['statuses']}; levels {result['levels']}")
    lines.extend(f"MISMATCH {m}" for m in c["mismatches"])
    return "\n".join(lines)
