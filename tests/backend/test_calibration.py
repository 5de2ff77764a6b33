"""The calibration set: calls recorded through StepRecorder around the tiny preset's torch steps, written to
`calib/<model-hash>/` (npz per step, ranges, weight scales, manifest) and read back checked; a corrupt or missing
file is a one-line error saying to rerun `vla-node calibrate`; the digest is stable and follows the samples."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vla_node.backends.calibration import (
    CalibrationError,
    StepRecorder,
    calibrated_tensors,
    calibration_folder,
    find_calibration,
    read_calibration,
    write_calibration,
)
from vla_node.backends.engine import TorchEngine
from vla_node.backends.export import export_step
from vla_node.backends.store import weights_digest
from vla_node.bench.engines import STEPS, step_inputs
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.validate import ConfigError

ort = pytest.importorskip("onnxruntime", reason="onnxruntime's calibrator computes the activation ranges")
onnx = pytest.importorskip("onnx", reason="onnx reads the exported graphs")
STEPS_RECORDED = ("text", "tick")
LIMIT, CALLS = 3, 5


def perturbed(base: dict[str, torch.Tensor], call: int) -> dict[str, torch.Tensor]:
    """The step's seeded inputs with per-call noise on the float inputs (not the bias: it stays 0 / -inf)."""
    g = torch.Generator().manual_seed(call)
    return {n: t + 0.05 * (call + 1) * torch.randn(t.shape, generator=g) if t.is_floating_point() and n != "bias"
            else t.clone() for n, t in base.items()}


def record(model, step: str, limit: int = LIMIT, calls: int = CALLS):
    """`calls` calls of the step through a recorder around its TorchEngine, into one set of caller-owned input and
    output buffers refilled per call (as the runtime does). Returns the recorder and each call's inputs."""
    cls, outputs = STEPS[step]
    base = step_inputs(model.config)[step]
    recorder = StepRecorder(TorchEngine(cls(model), list(base), outputs), limit)
    buffers = {n: torch.empty_like(t) for n, t in base.items()}
    with torch.inference_mode():
        results = recorder.step(*base.values())
    outs = {n: torch.empty_like(r) for n, r in zip(outputs, results)}
    given = []
    for call in range(calls):
        for n, t in perturbed(base, call).items():
            buffers[n].copy_(t)
        given.append({n: t.clone() for n, t in buffers.items()})
        recorder.run(buffers, outs)
    return recorder, given


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model, its text and tick steps exported, their recorded calls, and the set written from them."""
    model = build_vla(preset("tiny"), seed=0)
    folder = tmp_path_factory.mktemp("tiny-steps")
    inputs = step_inputs(model.config)
    graphs, samples, given = {}, {}, {}
    for step in STEPS_RECORDED:
        cls, outputs = STEPS[step]
        graphs[step] = folder / f"{step}.onnx"
        export_step(cls(model), inputs[step], outputs, graphs[step])
        recorder, given[step] = record(model, step)
        samples[step] = recorder.samples
    model_hash = weights_digest(model)
    root = tmp_path_factory.mktemp("calib")
    written = write_calibration(root, model_hash, samples, "drives/test.mcap", graphs)
    return {"model": model, "graphs": graphs, "samples": samples, "given": given, "hash": model_hash, "root": root,
            "folder": written}


def test_the_recorder_forwards_every_call_and_keeps_clones_of_the_first_limit(tiny):
    model = tiny["model"]
    recorder, given = record(model, "tick")
    assert recorder.input_names == tuple(step_inputs(model.config)["tick"])
    assert recorder.output_names == STEPS["tick"][1]
    assert recorder.full and len(recorder.samples) == LIMIT
    for sample, inputs in zip(recorder.samples, given):  # the calls' values, not the buffers' last content
        assert sample.keys() == inputs.keys()
        for name in inputs:
            torch.testing.assert_close(sample[name], inputs[name], rtol=0, atol=0)
    assert not torch.equal(recorder.samples[0]["state_x"], recorder.samples[1]["state_x"])
    # outputs: the wrapped engine's, and a recorder wraps a recorder (attributes pass through both)
    inner = TorchEngine(STEPS["tick"][0](model), recorder.input_names, recorder.output_names)
    outer = StepRecorder(StepRecorder(inner, 1), 2)
    assert outer.step is inner.step
    ours = {n: torch.empty_like(r) for n, r in zip(recorder.output_names, inner.step(*given[-1].values()))}
    theirs = {n: torch.empty_like(t) for n, t in ours.items()}
    outer.run(given[-1], ours)
    inner.run(given[-1], theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=0)
    assert len(outer.samples) == 1 and len(outer.engine.samples) == 1
    with pytest.raises(ValueError, match="limit = 0"):
        StepRecorder(inner, 0)


def test_the_set_on_disk_holds_the_samples_ranges_weight_scales_and_manifest(tiny):
    folder = tiny["folder"]
    assert folder == calibration_folder(tiny["root"], tiny["hash"])
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "ranges.json", "text.npz", "tick.npz",
                                                        "weights.json"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["model_hash"] == tiny["hash"] and manifest["source"] == "drives/test.mcap"
    assert set(manifest["files"]) == {"ranges.json", "text.npz", "tick.npz", "weights.json"}
    for step in STEPS_RECORDED:
        entry = manifest["steps"][step]
        assert entry["count"] == LIMIT and entry["onnx"] == f"{step}.onnx"
        with np.load(folder / f"{step}.npz") as z:
            assert set(z.files) == set(entry["inputs"])
            for name, info in entry["inputs"].items():
                expected = np.stack([s[name].numpy() for s in tiny["samples"][step]])
                np.testing.assert_array_equal(z[name], expected)
                assert info == {"shape": list(expected.shape[1:]), "dtype": str(expected.dtype)}
    ranges = json.loads((folder / "ranges.json").read_text())  # strict JSON: no NaN or Infinity
    assert ranges["calibrate_method"] == "MinMax"
    bias = np.stack([s["bias"].numpy() for s in tiny["samples"]["tick"]])
    state = np.stack([s["state_x"].numpy() for s in tiny["samples"]["tick"]])
    tick = ranges["steps"]["tick"]
    assert tick["inputs"]["state_x"] == pytest.approx({"min": state.min(), "max": state.max(),
                                                       "absmax": np.abs(state).max(), "nonfinite": 0})
    assert tick["inputs"]["bias"]["nonfinite"] == int(np.isinf(bias).sum()) > 0
    assert tick["inputs"]["bias"]["max"] == 0.0
    graph = onnx.load(str(tiny["graphs"]["tick"]))
    activations = tick["activations"]
    assert set(activations) == set(calibrated_tensors(graph)) and len(activations) >= 2
    assert all(r["min"] <= r["max"] and r["absmax"] == max(-r["min"], r["max"]) > 0 for r in activations.values())
    weights = json.loads((folder / "weights.json").read_text())["steps"]["tick"]
    arrays = {i.name: onnx.numpy_helper.to_array(i) for i in graph.graph.initializer}
    q = weights["layers.0.self_attn.q_proj.weight"]  # a Gemm with transB: [out, in], channels on axis 0
    w = arrays["layers.0.self_attn.q_proj.weight"]
    assert q["op"] == "Gemm" and q["axis"] == 0 and q["shape"] == list(w.shape)
    np.testing.assert_allclose(q["scales"], np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert "lm_head.weight" in weights and "embed_tokens" not in " ".join(weights)  # the Gather stays float


def test_read_back_gives_the_samples_and_a_reader_onnx_runtime_takes(tiny):
    data = read_calibration(tiny["folder"], tiny["hash"])
    assert data.steps == STEPS_RECORDED and data.model_hash == tiny["hash"]
    assert data.count("tick") == LIMIT
    shapes = data.shapes("tick")
    assert shapes == {n: tuple(t.shape) for n, t in step_inputs(tiny["model"].config)["tick"].items()}
    assert data.step_of(shapes) == "tick"
    reader = data.reader("tick")
    assert isinstance(reader, ort.quantization.CalibrationDataReader) and len(reader) == LIMIT
    feeds = list(reader)
    assert len(feeds) == LIMIT and reader.get_next() is None
    np.testing.assert_array_equal(feeds[1]["prefix_k"], tiny["samples"]["tick"][1]["prefix_k"].numpy())
    reader.set_range(1, 2)
    assert len(reader) == 1 and reader.get_next()["state_x"].shape == shapes["state_x"] and reader.get_next() is None
    narrowed = data.for_step("tick")
    assert narrowed.steps == ("tick",) and narrowed.digest != data.digest  # covers the tick alone
    with pytest.raises(CalibrationError, match="no step 'frame'.*vla-node calibrate"):
        data.samples("frame")


def one_line_error(folder, *fragments, model_hash=None):
    with pytest.raises(CalibrationError) as info:
        read_calibration(folder, model_hash)
    message = str(info.value)
    assert "\n" not in message and "rerun `vla-node calibrate`" in message, message
    for fragment in fragments:
        assert fragment in message, message


def copy_set(tiny, tmp_path):
    return write_calibration(tmp_path, tiny["hash"], tiny["samples"], "drives/test.mcap", tiny["graphs"])


def test_a_corrupt_or_missing_file_is_a_one_line_error_naming_it(tiny, tmp_path):
    folder = copy_set(tiny, tmp_path / "a")
    data = (folder / "tick.npz").read_bytes()
    (folder / "tick.npz").write_bytes(data[: len(data) // 2])  # truncated
    one_line_error(folder, "tick.npz", "corrupt or truncated")
    (folder / "tick.npz").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    one_line_error(folder, "tick.npz", "corrupt")
    (folder / "tick.npz").unlink()
    one_line_error(folder, "tick.npz", "missing")
    folder = copy_set(tiny, tmp_path / "b")
    (folder / "ranges.json").unlink()
    one_line_error(folder, "ranges.json", "missing")
    (folder / "manifest.json").write_text("{not json")
    one_line_error(folder, "manifest.json", "unreadable")
    (folder / "manifest.json").unlink()
    one_line_error(folder, "manifest.json missing")
    one_line_error(copy_set(tiny, tmp_path / "c"), "recorded with model", model_hash="0" * 64)


def test_the_digest_is_stable_and_changes_when_a_sample_changes(tiny, tmp_path):
    first = read_calibration(tiny["folder"])
    again = read_calibration(copy_set(tiny, tmp_path / "again"))  # written anew, elsewhere: same bytes, same digest
    assert again.digest == first.digest and len(first.digest) == 64
    assert (tiny["folder"] / "tick.npz").read_bytes() == (again.folder / "tick.npz").read_bytes()
    changed = {step: [dict(s) for s in samples] for step, samples in tiny["samples"].items()}
    changed["tick"][2]["state_x"] = changed["tick"][2]["state_x"].clone()
    changed["tick"][2]["state_x"][0, 0] += 1e-3
    other = read_calibration(write_calibration(tmp_path / "changed", tiny["hash"], changed, "drives/test.mcap"))
    assert other.digest != first.digest
    assert other.step_digest("tick") != first.step_digest("tick")
    without_graphs = read_calibration(write_calibration(tmp_path / "plain", tiny["hash"], tiny["samples"], "x"))
    assert without_graphs.activation_ranges("tick") is None and without_graphs.weight_scales("tick") is None
    assert without_graphs.digest != first.digest  # the ranges and scales a graph adds are content too


def test_bad_samples_and_names_are_refused(tiny, tmp_path):
    samples = [dict(s) for s in tiny["samples"]["tick"]]
    samples[1]["state_x"] = samples[1]["state_x"][:1]
    with pytest.raises(ValueError, match=r"sample 1 of step tick: input state_x is float32 \[1, 64\], expected"):
        write_calibration(tmp_path, tiny["hash"], {"tick": samples}, "x")
    with pytest.raises(ValueError, match="step tick: no samples"):
        write_calibration(tmp_path, tiny["hash"], {"tick": []}, "x")
    with pytest.raises(ValueError, match="calibration step '../tick'"):
        write_calibration(tmp_path, tiny["hash"], {"../tick": tiny["samples"]["tick"]}, "x")
    with pytest.raises(ValueError, match=r"fp32 ONNX given for steps \['frame'\] without samples"):
        write_calibration(tmp_path, tiny["hash"], {"tick": tiny["samples"]["tick"]}, "x",
                          {"frame": tiny["graphs"]["tick"]})
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_find_calibration_reads_the_models_set_or_says_to_record_one(tiny, tmp_path):
    found = find_calibration(tiny["root"], tiny["model"])
    assert found.folder == tiny["folder"] and found.model_hash == tiny["hash"]
    with pytest.raises(CalibrationError, match="no calibration set of this model .* in .*run `vla-node calibrate`"):
        find_calibration(tmp_path, tiny["model"])
    with pytest.raises(ConfigError):  # the command line's one-line errors
        find_calibration(tmp_path / "none", build_vla(preset("tiny"), seed=1))
