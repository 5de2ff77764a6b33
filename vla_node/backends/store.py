"""The engine store: built engines cached under `engines/<step>-<recipe>-<key>/`, rebuilt on any mismatch.

The key hashes everything an engine depends on: the model weights, the step and its input shapes, the recipe, the
calibration, the backend and its version, and the device (GPU name and compute capability, or the CPU's model and
the kernels it runs). A folder holds the engine's files and `manifest.json` (the key's fields and every file's
SHA-256); a folder whose manifest is missing, unreadable, of another key, or whose files do not match their hashes
(corrupt, truncated) is treated as missing: rebuilt, or with building refused, a one-line error naming the command
that builds it. A build writes into a temporary folder and renames it into place, so a crash mid-build leaves no
half-written engine behind. Builds hold the store's lock (an flock on its folder, which the kernel drops with the
process): two processes never build the same engine at once, and under the lock a temporary folder is one a killed
build left behind, removed before the next build.

A store's `exports/` is a store of its own: one fp32 ONNX export per step, weights and shapes (and exporter
versions), which every recipe and backend built from that step copies instead of exporting again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from vla_node.backends.folders import replaced_folder, sha256

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
EXPORTS = "exports"  # a store's sub-store of fp32 ONNX exports, one per step, weights and shapes, for every recipe
# folders.replaced_folder's temporary folders: "." + the engine folder's name + "-" + mkdtemp's 8 characters
_BUILDING = re.compile(r"\.[^/]+-[0-9a-f]{16}-[a-z0-9_]{8}")


class EngineStoreError(RuntimeError):
    """No usable engine and building it is not allowed (or it failed): the message says what to run."""


@dataclasses.dataclass(frozen=True)
class EngineKey:
    step: str                      # text | frame | tick | ...
    recipe: str                    # fp32 | int8-ort | int8-trt | ...
    backend: str                   # onnxruntime | tensorrt
    backend_version: str
    device: str                    # what the engine is built for (device_description)
    weights: str                   # weights_digest of the model
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # every input's name and shape
    calibration: str | None = None  # the calibration set's hash, for int8 recipes
    options: str = ""  # what else the step's arithmetic depends on (its code version, the shared-drift sample)

    def digest(self) -> str:
        fields = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(fields.encode()).hexdigest()[:16]

    def folder_name(self) -> str:
        return f"{self.step}-{self.recipe}-{self.digest()}"


def weights_digest(module: nn.Module) -> str:
    """SHA-256 over every parameter and buffer of `module`: name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def device_description(device: str = "cpu") -> str:
    """The device an engine is built for: a GPU's name and compute capability, or the CPU's model and the kernels
    oneDNN and ATen run on it (their instruction sets)."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
    from vla_node.backends import cpu_features

    cpuinfo = cpu_features.read_cpuinfo()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    return f"{model}; {cpu_features.describe()}"


class EngineStore:
    """Engines under `root`, one folder per key."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def folder(self, key: EngineKey) -> Path:
        return self.root / key.folder_name()

    def problem(self, key: EngineKey) -> str | None:
        """Why the key's folder is not a usable engine (None: it is)."""
        folder = self.folder(key)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            return "not built"
        except (OSError, ValueError) as e:
            return f"unreadable manifest ({e})"
        if not isinstance(manifest, dict) or manifest.get("key") != json.loads(json.dumps(dataclasses.asdict(key))):
            return "manifest of another key"
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "manifest lists no file"
        for name, digest in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} missing"
            if sha256(path) != digest:
                return f"{name} corrupt or truncated (its SHA-256 differs from the manifest's)"
        return None

    def get(self, key: EngineKey, build: Callable[[Path], None] | None, build_command: str) -> Path:
        """The key's engine folder, built first (`build(folder)` writes the engine's files into `folder`) when it is
        missing or unusable. With build=None a missing engine is an EngineStoreError naming `build_command`."""
        folder = self.folder(key)
        problem = self.problem(key)
        if problem is None:
            return folder
        if build is None:
            raise EngineStoreError(f"no usable {key.step} engine ({key.recipe}, {key.backend}) in {folder}: "
                                   f"{problem}; build it with `{build_command}`")
        with self._build_lock():
            self._remove_abandoned()
            problem = self.problem(key)  # another process may have built it while this one waited for the lock
            if problem is None:
                return folder
            if problem != "not built":
                log.warning("engine %s: %s; rebuilding", folder, problem)
            with replaced_folder(folder) as tmp:
                build(tmp)
                files = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
                if not files:
                    raise EngineStoreError(f"building the {key.step} engine ({key.recipe}) wrote no file")
                manifest = {"key": dataclasses.asdict(key), "files": files}
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return folder

    @contextlib.contextmanager
    def _build_lock(self) -> Iterator[None]:
        """The store's build lock: an exclusive flock on its folder (nothing written for it), across processes, and
        released by the kernel when this process dies, however."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.warning("engine store %s: another process is building; waiting for it", self.root)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _remove_abandoned(self) -> None:
        """Remove the temporary folders of builds that did not finish (killed): with the lock held, no build runs."""
        for path in self.root.iterdir():
            if path.is_dir() and _BUILDING.fullmatch(path.name):
                log.warning("engine store: removing %s, left by a build that did not finish", path)
                shutil.rmtree(path, ignore_errors=True)
