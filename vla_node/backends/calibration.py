"""The INT8 calibration set: real inputs of each step, recorded while the node runs, on disk under
`calib/<model-hash>/`.

A static INT8 graph (quantize.py's int8-trt) fixes one scale per activation tensor, so the scales must come from
the inputs the steps really see: `StepRecorder` wraps any engine and keeps a copy of the inputs of its first
`limit` calls, and `write_calibration` writes them with what is computed from them once:

    <step>.npz      every input of the step, stacked over the recorded calls: name -> array [N, ...]
    ranges.json     per step: each input's min / max / absmax over the samples (finite values; a count of the
                    non-finite ones, the biases' -inf), and, given the step's fp32 ONNX, the activation range ONNX
                    Runtime's MinMax calibrator computes for every tensor a quantized MatMul / Gemm / Conv reads
                    (the ranges int8-trt's Q/DQ scales are made from)
    weights.json    per step, given its fp32 ONNX: each quantized weight's per-output-channel symmetric int8 scale
                    (absmax / 127), the scales a Q/DQ graph of these weights carries (a check that a graph and a
                    set belong together)
    manifest.json   the model hash, the source (a drive or a frames folder), per step the sample count and every
                    input's shape and dtype, and the SHA-256 of every other file

`read_calibration` checks the manifest and every file against it: a missing, truncated or corrupt file is a
one-line CalibrationError naming it and saying to rerun `vla-node calibrate`. `CalibrationData.digest` hashes the
set's content (the model hash, each step's .npz SHA-256 and its stored ranges and scales; not where the samples
came from, nor when), and keys the engines built from it in the engine store (store.py). The .npz files are written
byte-for-byte deterministically (fixed zip timestamps), so the same samples give the same digest.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from vla_node.backends.folders import replaced_folder, sha256
from vla_node.validate import ConfigError

MANIFEST = "manifest.json"
RANGES = "ranges.json"
WEIGHTS = "weights.json"
FORMAT = 1
QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")  # the ops whose weights and inputs the int8 recipes quantize
CALIBRATE_METHOD = "MinMax"  # ONNX Runtime's calibrator behind the stored activation ranges (see quantize.py)
CALIBRATION_BATCH = 8  # samples whose intermediate tensors the calibrator holds before merging their ranges
RERUN = "rerun `vla-node calibrate`"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a step name or model hash: one safe path component
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # every .npz member's timestamp: same samples, same bytes


class CalibrationError(ConfigError):
    """A calibration set is missing, incomplete or corrupt, or does not fit the model or graph: one line naming the
    file or value and saying to rerun `vla-node calibrate` (a ConfigError: the command line prints it as one line)."""


# recording ----------------------------------------------------------------------------------------------------


class StepRecorder:
    """An engine that records: `run` forwards to `engine` and keeps a clone of the inputs of each of the first
    `limit` calls (`samples`, oldest first). It has the engine's `input_names` and `output_names`, and any other
    attribute is the wrapped engine's (a recorder can wrap another wrapper, and be wrapped)."""

    def __init__(self, engine, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"StepRecorder limit = {limit!r}: expected a positive number of calls")
        self.engine = engine
        self.limit = limit
        self.input_names = tuple(engine.input_names)
        self.output_names = tuple(engine.output_names)
        self.samples: list[dict[str, torch.Tensor]] = []

    @property
    def full(self) -> bool:
        """Whether `limit` calls are recorded (later calls are only forwarded)."""
        return len(self.samples) >= self.limit

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]) -> None:
        if not self.full:  # cloned before the call: the caller's buffers are refilled for the next one
            self.samples.append({name: inputs[name].detach().clone() for name in self.input_names})
        self.engine.run(inputs, outputs)

    def __getattr__(self, name: str):
        if name == "engine":  # not set yet (copy, unpickling): no recursion through self.engine
            raise AttributeError(name)
        return getattr(self.engine, name)


# graph facts ---------------------------------------------------------------------------------------------------


def quantized_weights(model) -> list[tuple[object, str, int]]:
    """(node, weight initializer name, output-channel axis) of every MatMul / Gemm / Conv of an onnx.ModelProto
    whose weight (input 1) is an initializer: the nodes the int8 recipes quantize. A MatMul's weight [K, N] has
    its output channels on axis 1, a Gemm's on axis 0 with transB (the exporter's [out, in] Linear weights) or 1,
    a Conv's [O, I, ...] on axis 0. MatMuls of two activations (attention) are not among them: they stay float."""
    initializers = {i.name for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type not in QUANTIZED_OPS or len(node.input) < 2 or node.input[1] not in initializers:
            continue
        if node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            axis = 0 if trans_b else 1
        else:
            axis = 1 if node.op_type == "MatMul" else 0
        found.append((node, node.input[1], axis))
    return found


def weight_scales(fp32_onnx: str | Path) -> dict[str, dict]:
    """Per quantized weight of the fp32 graph: its node, op, shape, output-channel axis and per-channel symmetric
    int8 scales (absmax over the other axes / 127; an all-zero channel gets 1, as ONNX Runtime's quantizer gives
    it: never a zero scale)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(fp32_onnx))
    arrays = {i.name: i for i in model.graph.initializer}
    scales = {}
    for node, name, axis in quantized_weights(model):
        if name in scales:
            continue
        w = numpy_helper.to_array(arrays[name]).astype(np.float32)
        absmax = np.abs(np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)).max(axis=1)
        scale = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
        scales[name] = {"node": node.name, "op": node.op_type, "shape": list(w.shape), "axis": axis,
                        "scales": [float(s) for s in scale]}
    return scales


def calibrated_tensors(model) -> list[str]:
    """The activations the int8 recipes quantize: the float input (0) of every quantized MatMul / Gemm / Conv."""
    return sorted({node.input[0] for node, _, _ in quantized_weights(model)})


def activation_ranges(fp32_onnx: str | Path, reader) -> dict[str, dict[str, float]]:
    """ONNX Runtime's MinMax calibrator over `reader` (a CalibrationDataReader) on the fp32 graph: min / max / absmax
    of every tensor `calibrated_tensors` names (merged every CALIBRATION_BATCH samples: bounded memory, the same
    ranges)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, create_calibrator

    wanted = calibrated_tensors(onnx.load(str(fp32_onnx), load_external_data=False))
    with tempfile.TemporaryDirectory(prefix="vla-calibrate-") as tmp:
        calibrator = create_calibrator(Path(fp32_onnx), list(QUANTIZED_OPS),
                                       augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                                       calibrate_method=CalibrationMethod.MinMax)
        # a batch at a time: each collect_data computes its batch's ranges and merges them with the ranges so far
        # (ONNX Runtime's max_intermediate_outputs would drop the batches it clears instead)
        for start in range(0, len(reader), CALIBRATION_BATCH):
            reader.set_range(start, start + CALIBRATION_BATCH)
            calibrator.collect_data(reader)
        computed = calibrator.compute_data()
        del calibrator
    ranges = {}
    for name in wanted:
        if name not in computed:
            raise CalibrationError(f"ONNX Runtime's calibrator computed no range for {name} of {fp32_onnx}")
        low, high = (float(np.asarray(v).reshape(-1)[0]) for v in computed[name].range_value)
        ranges[name] = {"min": low, "max": high, "absmax": max(abs(low), abs(high))}
    return ranges


# the reader ONNX Runtime's calibrators take ----------------------------------------------------------------------


class SampleReader:
    """An onnxruntime CalibrationDataReader over one step's stacked samples (input name -> array [N, ...]): one
    feed dict per sample, in order, then None. It is one by ONNX Runtime's own test (CalibrationDataReader's
    subclass hook: a callable `get_next`), so onnxruntime is not imported here. `set_range` limits it to
    [start, end) (ONNX Runtime's strided calibration); `rewind` starts it over."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = dict(arrays)
        self.count = len(next(iter(self.arrays.values()))) if self.arrays else 0
        self.start, self.end, self.index = 0, self.count, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        i = self.start + self.index
        if i >= self.end:
            return None
        self.index += 1
        return {name: a[i] for name, a in self.arrays.items()}

    def __len__(self) -> int:
        return self.end - self.start

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end, self.index = max(0, start_index), min(self.count, end_index), 0

    def rewind(self) -> None:
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        feed = self.get_next()
        if feed is None:
            raise StopIteration
        return feed


# writing ---------------------------------------------------------------------------------------------------------


def _check_name(what: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} {value!r}: expected letters, digits, '_', '.' or '-' (one path component)")


def _numpy(step: str, name: str, index: int, t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bfloat16:
            raise ValueError(f"calibration sample {index} of step {step}: input {name} is bfloat16, which .npz "
                             "cannot hold; record the float32 inputs the exported graph takes")
        return t.detach().to("cpu").numpy()
    return np.asarray(t)


def stack_samples(step: str, samples: Sequence[Mapping[str, object]]) -> dict[str, np.ndarray]:
    """One step's samples (dicts of input name -> tensor) stacked per input [N, ...]; every sample must have the
    first one's names, shapes and dtypes."""
    if not samples:
        raise ValueError(f"calibration step {step}: no samples (record at least one call)")
    first = {n: _numpy(step, n, 0, t) for n, t in samples[0].items()}
    if not first:
        raise ValueError(f"calibration step {step}: sample 0 has no inputs")
    for name in first:
        _check_name(f"input name of step {step}", name)
    columns: dict[str, list[np.ndarray]] = {n: [a] for n, a in first.items()}
    for i, sample in enumerate(samples[1:], start=1):
        if set(sample) != set(first):
            raise ValueError(f"calibration sample {i} of step {step}: inputs {sorted(sample)}, expected "
                             f"{sorted(first)} (sample 0's)")
        for name, t in sample.items():
            a = _numpy(step, name, i, t)
            if a.shape != first[name].shape or a.dtype != first[name].dtype:
                raise ValueError(f"calibration sample {i} of step {step}: input {name} is {a.dtype} {list(a.shape)}, "
                                 f"expected {first[name].dtype} {list(first[name].shape)} (sample 0's)")
            columns[name].append(a)
    return {n: np.ascontiguousarray(np.stack(c)) for n, c in columns.items()}


def _write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """np.savez's layout (one .npy member per array, read by np.load) with fixed timestamps: deterministic bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in arrays.items():
            with z.open(zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME), "w", force_zip64=True) as f:
                np.lib.format.write_array(f, a, allow_pickle=False)


def input_ranges(arrays: Mapping[str, np.ndarray]) -> dict[str, dict]:
    """Per input: min / max / absmax over the finite values of every sample and the count of non-finite values
    (a bias's -inf slots); None for an input with no finite value. Integers stay integers."""
    ranges = {}
    for name, a in arrays.items():
        if a.dtype == np.bool_:
            a = a.astype(np.int64)
        finite = a[np.isfinite(a)] if np.issubdtype(a.dtype, np.floating) else a.reshape(-1)
        if finite.size == 0:
            low = high = absmax = None
        else:
            low, high = finite.min().item(), finite.max().item()
            absmax = max(abs(low), abs(high))
        ranges[name] = {"min": low, "max": high, "absmax": absmax, "nonfinite": int(a.size - finite.size)}
    return ranges


def _dump(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_calibration(root: str | Path, model_hash: str, samples: Mapping[str, Sequence[Mapping[str, object]]],
                      source: str, onnx: Mapping[str, str | Path] | None = None) -> Path:
    """Write the calibration set of `samples` (step name -> the recorded inputs of its calls) into
    `root/<model_hash>/` and return that folder. `source`: where the samples came from (a drive path or a frames
    folder). `onnx` (step name -> its fp32 ONNX graph, optional per step): adds that step's activation ranges and
    weight scales. A set already there is replaced; the files are written into a temporary folder renamed into
    place, so a crash leaves the old set or the new one, never half of one."""
    _check_name("model hash", model_hash)
    onnx = dict(onnx or {})
    if not samples:
        raise ValueError("write_calibration: no step has samples (expected step name -> recorded inputs)")
    for step in samples:
        _check_name("calibration step", step)
    extra = sorted(set(onnx) - set(samples))
    if extra:
        raise ValueError(f"fp32 ONNX given for steps {extra} without samples; steps with samples: {sorted(samples)}")
    for step, path in onnx.items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"fp32 ONNX of step {step}: {path} does not exist (export the step first)")
    folder = Path(root) / model_hash
    with replaced_folder(folder) as tmp:
        ranges: dict[str, dict] = {}
        weights: dict[str, dict] = {}
        steps: dict[str, dict] = {}
        for step, recorded in samples.items():
            arrays = stack_samples(step, recorded)
            _write_npz(tmp / f"{step}.npz", arrays)
            ranges[step] = {"inputs": input_ranges(arrays)}
            if step in onnx:
                ranges[step]["activations"] = activation_ranges(onnx[step], SampleReader(arrays))
                weights[step] = weight_scales(onnx[step])
            steps[step] = {"count": len(recorded), "onnx": Path(onnx[step]).name if step in onnx else None,
                           "inputs": {n: {"shape": list(a.shape[1:]), "dtype": str(a.dtype)}
                                      for n, a in arrays.items()}}
        (tmp / RANGES).write_text(_dump({"calibrate_method": CALIBRATE_METHOD, "steps": ranges}))
        (tmp / WEIGHTS).write_text(_dump({"steps": weights}))
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir())}
        manifest = {"format": FORMAT, "model_hash": model_hash, "source": str(source),
                    "calibrate_method": CALIBRATE_METHOD, "steps": steps, "files": files}
        (tmp / MANIFEST).write_text(_dump(manifest))
    return folder


# reading ---------------------------------------------------------------------------------------------------------


class CalibrationData:
    """A calibration set read and checked by `read_calibration` (or one step of it: `for_step`).

    `samples(step)` loads a step's stacked inputs (name -> [N, ...]) on first use; `reader(step)` is an
    onnxruntime CalibrationDataReader over them; `input_ranges`, `activation_ranges` and `weight_scales` are the
    figures stored with them; `digest` hashes the content of the steps it holds (the engine store's key)."""

    def __init__(self, folder: Path, manifest: dict, ranges: dict, weights: dict,
                 steps: Iterable[str] | None = None) -> None:
        self.folder = folder
        self.manifest = manifest
        self.model_hash: str = manifest["model_hash"]
        self.source: str = manifest["source"]
        self.steps = tuple(manifest["steps"] if steps is None else steps)
        self._ranges = ranges
        self._weights = weights
        self._arrays: dict[str, dict[str, np.ndarray]] = {}

    def __repr__(self) -> str:
        return f"CalibrationData({self.folder}, steps={list(self.steps)}, digest={self.digest[:16]})"

    def _step(self, step: str) -> dict:
        if step not in self.steps:
            raise CalibrationError(f"calibration set {self.folder} has no step {step!r} (it has "
                                   f"{', '.join(self.steps)}); {RERUN} recording that step")
        return self.manifest["steps"][step]

    def count(self, step: str) -> int:
        """How many calls of `step` were recorded."""
        return self._step(step)["count"]

    def shapes(self, step: str) -> dict[str, tuple[int, ...]]:
        """Every input of `step` and its shape (one sample's, without the stacked N)."""
        return {n: tuple(i["shape"]) for n, i in self._step(step)["inputs"].items()}

    def samples(self, step: str) -> dict[str, np.ndarray]:
        """The step's inputs stacked over its samples: name -> array [N, ...] (checked against the manifest)."""
        entry = self._step(step)
        if step not in self._arrays:
            path = self.folder / f"{step}.npz"
            try:
                with np.load(path, allow_pickle=False) as z:
                    arrays = {n: z[n] for n in z.files}
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
                raise CalibrationError(f"calibration set {self.folder}: {path.name} unreadable "
                                       f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); {RERUN}") from None
            for name, info in entry["inputs"].items():
                a = arrays.get(name)
                expected = [entry["count"], *info["shape"]]
                if a is None or list(a.shape) != expected or str(a.dtype) != info["dtype"]:
                    got = "missing" if a is None else f"{a.dtype} {list(a.shape)}"
                    raise CalibrationError(f"calibration set {self.folder}: {path.name} input {name} is {got}, the "
                                           f"manifest says {info['dtype']} {expected}; {RERUN}")
            self._arrays[step] = {n: arrays[n] for n in entry["inputs"]}
        return self._arrays[step]

    def reader(self, step: str):
        """An onnxruntime CalibrationDataReader over the step's samples (a fresh one per call)."""
        return SampleReader(self.samples(step))

    def input_ranges(self, step: str) -> dict[str, dict]:
        """Per input of `step`: min / max / absmax over the samples' finite values, and the non-finite count."""
        self._step(step)
        return self._ranges["steps"][step]["inputs"]

    def activation_ranges(self, step: str) -> dict[str, dict] | None:
        """ONNX Runtime's MinMax ranges of the quantized layers' inputs in the step's fp32 graph (None: the set was
        written without that graph)."""
        self._step(step)
        return self._ranges["steps"][step].get("activations")

    def weight_scales(self, step: str) -> dict[str, dict] | None:
        """Per quantized weight of the step's fp32 graph: its per-channel symmetric int8 scales (None: written
        without the graph)."""
        self._step(step)
        return self._weights["steps"].get(step)

    def step_digest(self, step: str) -> str:
        """SHA-256 of one step's content: the model hash, its .npz file's hash, and its stored ranges and scales."""
        self._step(step)
        content = {"model_hash": self.model_hash, "step": step,
                   "samples": self.manifest["files"][f"{step}.npz"],
                   "ranges": self._ranges["steps"][step], "weights": self._weights["steps"].get(step),
                   "calibrate_method": self.manifest["calibrate_method"]}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    @property
    def digest(self) -> str:
        """SHA-256 of the steps this holds (their step_digest): the same samples, model and graphs give the same
        digest wherever and whenever they were written; any changed sample changes it."""
        parts = {step: self.step_digest(step) for step in sorted(self.steps)}
        return hashlib.sha256(json.dumps({"model_hash": self.model_hash, "steps": parts},
                                         sort_keys=True).encode()).hexdigest()

    def for_step(self, step: str) -> CalibrationData:
        """The set narrowed to one step (its digest covers that step alone); what a step's recipe takes."""
        self._step(step)
        narrowed = CalibrationData(self.folder, self.manifest, self._ranges, self._weights, steps=(step,))
        if step in self._arrays:
            narrowed._arrays[step] = self._arrays[step]
        return narrowed

    def step_of(self, inputs: Mapping[str, Sequence[int]]) -> str:
        """The step whose recorded inputs are exactly these names and shapes (a graph's inputs): the one step of a
        narrowed set, or the only match."""
        wanted = {n: tuple(s) for n, s in inputs.items()}
        matches = [s for s in self.steps if self.shapes(s) == wanted]
        if len(matches) == 1:
            return matches[0]
        have = "; ".join(f"{s}: {self.shapes(s)}" for s in self.steps)
        if not matches:
            raise CalibrationError(f"calibration set {self.folder} has no step recorded with inputs {wanted} (it has "
                                   f"{have}); {RERUN} for this graph")
        raise CalibrationError(f"calibration set {self.folder}: steps {matches} all have inputs {wanted}; narrow it "
                               "to one with for_step(name)")


def calibration_folder(root: str | Path, model_hash: str) -> Path:
    """Where the set of a model lives: `root/<model_hash>/` (root: normally `calib/`)."""
    _check_name("model hash", model_hash)
    return Path(root) / model_hash


def find_calibration(root: str | Path, model) -> CalibrationData:
    """The calibration set of `model` (a VLA: its weights_digest names the folder) under `root` (the launch file's
    `model.calibration`, normally `calib/`), read and checked; none there is a CalibrationError saying to run
    `vla-node calibrate`."""
    from vla_node.backends.store import weights_digest

    model_hash = weights_digest(model)
    folder = calibration_folder(root, model_hash)
    if not folder.is_dir():
        others = sorted(p.name[:16] for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []
        also = f" (it holds sets of models {', '.join(others)})" if others else ""
        raise CalibrationError(f"no calibration set of this model ({model_hash[:16]}) in {root}{also}; run "
                               "`vla-node calibrate` to record one")
    return read_calibration(folder, model_hash)


def _load_json(folder: Path, name: str) -> dict:
    try:
        value = json.loads((folder / name).read_text())
    except FileNotFoundError:
        raise CalibrationError(f"calibration set {folder}: {name} missing; {RERUN}") from None
    except (OSError, ValueError) as e:
        raise CalibrationError(f"calibration set {folder}: {name} unreadable ({str(e).splitlines()[0]}); "
                               f"{RERUN}") from None
    if not isinstance(value, dict):
        raise CalibrationError(f"calibration set {folder}: {name} is not a JSON object; {RERUN}")
    return value


def read_calibration(folder: str | Path, model_hash: str | None = None) -> CalibrationData:
    """The calibration set in `folder` (a `calib/<model-hash>/`), its manifest and every file checked: a missing,
    truncated or corrupt file, or (given `model_hash`) a set made for another model, is a one-line CalibrationError
    naming it and saying to rerun `vla-node calibrate`. Samples are loaded when first asked for."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise CalibrationError(f"no calibration set in {folder} ({MANIFEST} missing); {RERUN}")
    manifest = _load_json(folder, MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CalibrationError(f"calibration set {folder}: manifest format {manifest.get('format')!r}, expected "
                               f"{FORMAT}; {RERUN}")
    steps, files = manifest.get("steps"), manifest.get("files")
    if not isinstance(steps, dict) or not steps or not isinstance(files, dict):
        raise CalibrationError(f"calibration set {folder}: {MANIFEST} lists no step or no file; {RERUN}")
    if not isinstance(manifest.get("model_hash"), str) or "source" not in manifest:
        raise CalibrationError(f"calibration set {folder}: {MANIFEST} has no model hash or source; {RERUN}")
    if model_hash is not None and manifest["model_hash"] != model_hash:
        raise CalibrationError(f"calibration set {folder} was recorded with model {manifest['model_hash'][:16]}, "
                               f"this model is {model_hash[:16]}; {RERUN} with this model")
    for name in [RANGES, WEIGHTS, *(f"{s}.npz" for s in steps)]:
        if name not in files:
            raise CalibrationError(f"calibration set {folder}: {MANIFEST} does not list {name}; {RERUN}")
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            raise CalibrationError(f"calibration set {folder}: {name} missing; {RERUN}")
        if sha256(path) != digest:
            raise CalibrationError(f"calibration set {folder}: {name} corrupt or truncated (its SHA-256 differs from "
                                   f"the manifest's); {RERUN}")
    ranges, weights = _load_json(folder, RANGES), _load_json(folder, WEIGHTS)
    if set(ranges.get("steps", {})) != set(steps) or not isinstance(weights.get("steps"), dict):
        raise CalibrationError(f"calibration set {folder}: {RANGES} or {WEIGHTS} does not cover the manifest's steps "
                               f"{sorted(steps)}; {RERUN}")
    return CalibrationData(folder, manifest, ranges, weights)
