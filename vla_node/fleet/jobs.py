"""The jobs of a fleet run: drives listed from paths, folders and list files, each repeated; their shards."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from vla_node.validate import ConfigError, require

DRIVE_SUFFIXES = (".mcap", ".mp4", ".mkv", ".mov", ".avi")


@dataclass(frozen=True)
class Job:
    """One replay: a drive (its path as given, read where it is) and which repeat of it."""

    drive: str
    drive_id: str  # the drive's name in the fleet: its stem, made unique by a hash of its path when stems collide
    repeat: int

    @property
    def key(self) -> str:
        return f"{self.drive_id}-r{self.repeat}"


def list_drives(items: list[str]) -> list[Path]:
    """Drives from paths: a drive file, a folder (its drives, sorted), or a list file (.txt: one path per line,
    relative to the list's folder; blank lines and # comments skipped). Order kept, duplicates dropped."""
    require(len(items) >= 1, "drives", items, "one or more drives, folders or list files")
    out: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in DRIVE_SUFFIXES and p.is_file())
            require(bool(found), "drives", item, f"a folder holding drives ({', '.join(DRIVE_SUFFIXES)})")
            out += found
        elif path.suffix.lower() == ".txt":
            require(path.is_file(), "drives", item, "an existing list file")
            for n, line in enumerate(path.read_text().splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if line:
                    drive = Path(line) if Path(line).is_absolute() else path.parent / line
                    if not drive.is_file():
                        raise ConfigError(f"{path}:{n}: drive {line!r}: no such file")
                    out.append(drive)
        else:
            require(path.is_file(), "drives", item, "an existing drive file, a folder of drives or a .txt list")
            out.append(path)
    unique = list(dict.fromkeys(p.resolve() for p in out))
    require(bool(unique), "drives", items, "at least one drive")
    return unique


def make_jobs(drives: list[Path], repeat: int = 1) -> list[Job]:
    """One job per (drive, repeat), drives in order, repeats inside."""
    require(type(repeat) is int and repeat >= 1, "repeat", repeat, "an integer >= 1")
    stems = [d.stem for d in drives]
    jobs = []
    for drive in drives:
        drive_id = drive.stem
        if stems.count(drive.stem) > 1:
            drive_id += "-" + hashlib.sha1(str(drive).encode()).hexdigest()[:6]
        jobs += [Job(str(drive), drive_id, k) for k in range(repeat)]
    return jobs


def shard(jobs: list[Job], index: int, count: int) -> list[Job]:
    """The jobs of drives whose position in the list mod count is index (all repeats of a drive in one shard)."""
    require(type(count) is int and count >= 1, "count", count, "an integer >= 1")
    require(type(index) is int and 0 <= index < count, "index", index, f"an integer in [0, {count - 1}]")
    drive_ids = list(dict.fromkeys(job.drive_id for job in jobs))
    mine = {d for n, d in enumerate(drive_ids) if n % count == index}
    return [job for job in jobs if job.drive_id in mine]
