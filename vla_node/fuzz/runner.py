"""`run_fuzz`: a time-boxed mutation-fuzzing campaign over the targets, behind `vla-node fuzz`.

Every target's seeds run first (whatever the budget), then mutated inputs until the time is up, the targets taking
turns so that each gets an equal share of the wall time. Each target has its own random stream (seeded by `seed`
and its name), so a target's sequence of inputs does not depend on the others. An input whose outcome is new for
its target (a rejection reason not seen yet) joins that target's corpus.

Inputs run in a worker process (worker.py): one answering late is a hang, one that kills it a crash, one that grows
its peak memory past the target's limit a memory failure; the worker is then replaced. Every failing input is
saved under `out_dir/<target>/` (the first few per distinct failure) with a .txt beside it saying what went wrong.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, TextIO

import msgpack

from vla_node.fuzz.mutate import havoc
from vla_node.fuzz.targets import TARGETS, Target
from vla_node.progress import Progress

FIRST_INPUT_DEADLINE_S = 120.0  # a fresh worker's first input of a target may pay for lazy imports
STARTUP_S = 180.0  # the worker importing every target's modules
MAX_CORPUS = 256
SAVED_PER_SIGNATURE = 3
WARM_IMPORTS = {"drive": ("vla_node.drives.open", "mcap_ros2.decoder"), "launch": ("vla_node.config",),
                "checkpoint": ("torch", "vla_node.model.checkpoint", "vla_node.model.vla")}


class WorkerDied(Exception):
    pass


class Worker:
    """The worker process and its pipe: run(ref, data, ...) -> its answer, or a hang / crash answer."""

    def __init__(self, refs: list[str], imports: list[str], log: TextIO) -> None:
        self.refs, self.imports, self.log = refs, imports, log
        self.proc: subprocess.Popen | None = None
        self.started = 0
        self.first: set[str] = set()

    def _env(self) -> dict:
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]  # the worker imports what this process can
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "vla_node.fuzz.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=self._env(), start_new_session=True)
        self.started += 1
        self.first = set()
        self._send({"op": "init", "refs": self.refs, "imports": self.imports})
        answer = self._receive(STARTUP_S)
        if not answer.get("ready"):
            raise RuntimeError(f"fuzz worker did not start: {answer}")

    def _send(self, message: dict) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        try:
            self.proc.stdin.write(struct.pack(">I", len(body)) + body)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(f"worker pipe closed ({e})") from None

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        out = b""
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise WorkerDied("the worker closed its pipe")
            out += chunk
        return out

    def _receive(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        (n,) = struct.unpack(">I", self._read_exact(4, deadline))
        return msgpack.unpackb(self._read_exact(n, deadline), raw=False)

    def run(self, target: Target, data: bytes) -> dict:
        if self.proc is None:
            self.start()
        deadline = target.deadline_s if target.name in self.first else max(target.deadline_s, FIRST_INPUT_DEADLINE_S)
        self.first.add(target.name)
        try:
            self._send({"op": "run", "ref": target.ref, "data": data, "memory_mb": target.memory_mb})
            return self._receive(deadline)
        except TimeoutError:
            self.kill()
            return {"verdict": "failure", "kind": "hang", "signature": f"hang:{target.name}",
                    "detail": f"no answer within {deadline:.1f} s"}
        except WorkerDied:
            try:
                status = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # closed its pipe yet still running: ended below
                status = None
            self.kill()
            what = f"signal {-status}" if status is not None and status < 0 else f"exit status {status}"
            return {"verdict": "failure", "kind": "crash", "signature": f"crash:{target.name}:{what}",
                    "detail": f"the worker died ({what}; its stderr is in worker.log)"}

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker's own session: it and any helper it forked
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._close()

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def _close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self.proc = None


@dataclasses.dataclass
class TargetRun:
    """One target's state in a campaign."""

    target: Target
    rng: random.Random
    corpus: list[bytes]
    seeds: int
    inputs: int = 0
    accepted: int = 0
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seconds: float = 0.0
    seen: set = dataclasses.field(default_factory=set)  # outcomes (accepted, rejection reasons) met so far

    def next_input(self) -> bytes:
        """A mutation of a seed (half the time: they parse furthest) or of any corpus input."""
        pool = self.seeds if self.rng.random() < 0.5 else len(self.corpus)
        parent = self.corpus[self.rng.randrange(pool)]
        others = self.rng.sample(self.corpus, min(8, len(self.corpus)))
        try:
            data = self.target.mutate(parent, self.rng, others)
        except Exception:  # noqa: BLE001 - a mutator that trips over a damaged input falls back to bytes
            data = havoc(parent, self.rng, others)
        return bytes(data[: self.target.max_bytes])

    def summary(self) -> dict:
        return {"inputs": self.inputs, "seeds": self.seeds, "accepted": self.accepted,
                "rejected": sum(self.reasons.values()), "reasons": dict(self.reasons.most_common()),
                "failures": dict(self.failures), "corpus": len(self.corpus), "seconds": round(self.seconds, 2)}


def _save(out_dir: Path, name: str, answer: dict, data: bytes, seed: int) -> Path:
    digest = hashlib.sha1(data).hexdigest()[:12]
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{answer['kind']}-{digest}.bin"
    path.write_bytes(data)
    path.with_suffix(".txt").write_text(
        f"target: {name}\nkind: {answer['kind']}\nsignature: {answer['signature']}\nseed: {seed}\n"
        f"detail: {answer['detail']}\nreproduce: python -c \"from pathlib import Path; import tempfile; "
        f"from vla_node.fuzz.targets import TARGETS; print(TARGETS[{name!r}].run(Path({str(path)!r}).read_bytes(), "
        f"Path(tempfile.mkdtemp())))\"\n")
    return path


def run_fuzz(minutes: float, seed: int = 0, targets: Iterable[str | Target] | None = None,
             out_dir: str | Path = "out/fuzz", progress: bool = True) -> dict:
    """Fuzz `targets` (names or Target objects; default all) for about `minutes` after their seeds; failing inputs
    go to out_dir. Returns the summary (also written to out_dir/summary.json): counts per target and failures."""
    if not (isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and 0 <= minutes < 1e6):
        raise ValueError(f"minutes = {minutes!r}: expected a number >= 0")
    chosen = [TARGETS[t] if isinstance(t, str) else t for t in (targets or list(TARGETS))]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for t in chosen:
        seeds = [data for _, data in t.seeds()]
        runs.append(TargetRun(t, random.Random(f"{seed}:{t.name}"), list(seeds), len(seeds)))
    imports = sorted({m for t in chosen for m in WARM_IMPORTS.get(t.name, ())})
    failures: dict[str, dict] = {}
    started = time.monotonic()
    with open(out_dir / "worker.log", "w") as log, Progress(None, "fuzz", unit="inputs", enabled=progress) as bar:
        worker = Worker(sorted({t.ref for t in chosen}), imports, log)
        try:
            queue = [(run, data) for run in runs for data in list(run.corpus)]  # the seeds, unmutated
            deadline = time.monotonic() + minutes * 60.0
            while True:
                seed_input = bool(queue)
                if queue:
                    run, data = queue.pop(0)
                elif time.monotonic() < deadline:
                    run = min(runs, key=lambda r: r.seconds)
                    data = run.next_input()
                else:
                    break
                t0 = time.monotonic()
                answer = worker.run(run.target, data)
                run.seconds += time.monotonic() - t0
                run.inputs += 1
                bar.update()
                _record(run, answer, data, failures, out_dir, seed, keep=not seed_input)
        finally:
            worker.stop()
        restarts = max(worker.started - 1, 0)
    summary = {
        "seed": seed, "minutes": minutes, "seconds": round(time.monotonic() - started, 1), "out_dir": str(out_dir),
        "ok": not failures, "worker_restarts": restarts,
        "targets": {r.target.name: r.summary() for r in runs},
        "failures": sorted(failures.values(), key=lambda f: (f["target"], f["signature"])),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _record(run: TargetRun, answer: dict, data: bytes, failures: dict, out_dir: Path, seed: int, keep: bool) -> None:
    """Count one answer; save a failing input; keep an input with a new outcome in the corpus (`keep`)."""
    verdict = answer["verdict"]
    if verdict == "accepted":
        run.accepted += 1
        reason = "accepted"
    elif verdict == "rejected":
        reason = answer["reason"]
        run.reasons[reason] += 1
    else:
        run.failures[answer["kind"]] += 1
        key = f"{run.target.name}:{answer['signature']}"
        entry = failures.setdefault(key, {"target": run.target.name, "kind": answer["kind"],
                                          "signature": answer["signature"], "detail": answer["detail"],
                                          "count": 0, "files": []})
        entry["count"] += 1
        if len(entry["files"]) < SAVED_PER_SIGNATURE:
            entry["files"].append(str(_save(out_dir, run.target.name, answer, data, seed)))
        return
    if reason not in run.seen:
        run.seen.add(reason)
        if not keep:
            return
        if len(run.corpus) < MAX_CORPUS:
            run.corpus.append(data)
        else:
            run.corpus[run.seeds + run.rng.randrange(MAX_CORPUS - run.seeds)] = data


def format_summary(summary: dict) -> str:
    """The per-target counts as a table, then one line per distinct failure."""
    lines = [f"{'target':<11} {'inputs':>8} {'accepted':>9} {'rejected':>9} {'failures':>9}  top rejection reasons"]
    for name, t in summary["targets"].items():
        top = ", ".join(f"{r} {n}" for r, n in list(t["reasons"].items())[:3])
        lines.append(f"{name:<11} {t['inputs']:>8} {t['accepted']:>9} {t['rejected']:>9} "
                     f"{sum(t['failures'].values()):>9}  {top}")
    total = sum(t["inputs"] for t in summary["targets"].values())
    lines.append(f"{total} inputs in {summary['seconds']} s (seed {summary['seed']}), worker restarts "
                 f"{summary['worker_restarts']}")
    for f in summary["failures"]:
        lines.append(f"FAILURE {f['target']} {f['kind']} x{f['count']}: {f['detail'][:200]}")
        lines.extend(f"  saved {path}" for path in f["files"])
    return "\n".join(lines)
