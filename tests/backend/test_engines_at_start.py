"""The node's backend, resolved once at start: the launch file's backend and fallback order, engines built where
missing (`vla-node build-engines` or at start), rebuilt when corrupt, and a one-line error where they cannot be."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers.node_helpers import TINY_LAUNCH
from vla_node.backends import engine_set as engine_set_module
from vla_node.backends.quantize import RECIPES as QUANTIZE_RECIPES
from vla_node.backends.store import EXPORTS
from vla_node.cli import main
from vla_node.config import BACKENDS, RECIPES, load_launch
from vla_node.node.pipeline import Pipeline
from vla_node.node.policies import resolve_backend
from vla_node.runtime.engine_policy import EnginePolicy
from vla_node.validate import ConfigError

pytest.importorskip("onnxruntime", reason="onnxruntime runs the exported steps")


def onnxruntime_launch(tmp_path, **model) -> object:
    """tests/launch/tiny.toml on onnxruntime with its store under tmp_path, as a file and a config."""
    path = tmp_path / "tiny-onnxruntime.toml"
    keys = {"backend": "onnxruntime", "engines_dir": str(tmp_path / "engines"), **model}
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    path.write_text(TINY_LAUNCH.read_text().replace("[model]\n", f"[model]\n{lines}", 1))
    return path


def test_the_config_knows_every_backend_and_recipe():
    assert BACKENDS == engine_set_module.BACKENDS and RECIPES == QUANTIZE_RECIPES


def test_no_build_with_nothing_built_says_what_to_run(tmp_path, capsys):
    launch = onnxruntime_launch(tmp_path)
    assert main(["run", "--launch", str(launch), "--no-build"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "not built" in err and "vla-node build-engines --launch" in err


def test_build_engines_then_start_then_a_corrupt_engine_is_rebuilt(tmp_path, capsys):
    launch = onnxruntime_launch(tmp_path)
    assert main(["build-engines", "--launch", str(launch)]) == 0
    out = capsys.readouterr().out
    assert "[1/" in out and "built in" in out
    config = load_launch(launch)
    pipeline = Pipeline(config.replace(model=dataclasses.replace(config.model, build_engines=False)),
                        warm_up_rounds=1)
    assert isinstance(pipeline.policy, EnginePolicy) and pipeline.backend.backend == "onnxruntime"
    # corrupt one engine file: with building refused, one line at start; with building, rebuilt
    folder = next(p for p in (tmp_path / "engines").iterdir() if p.name.startswith("tick-"))
    graph = folder / "tick.onnx"
    graph.write_bytes(graph.read_bytes()[:100])
    with pytest.raises(ConfigError, match="corrupt or truncated") as e:
        Pipeline(config.replace(model=dataclasses.replace(config.model, build_engines=False)), warm_up_rounds=1)
    assert "\n" not in str(e.value) and "vla-node build-engines" in str(e.value)
    Pipeline(config, warm_up_rounds=1)
    assert len(graph.read_bytes()) > 100


def test_a_backend_this_machine_cannot_run_falls_back_in_order(tmp_path):
    launch = onnxruntime_launch(tmp_path, backend="tensorrt", fallback=["cudagraph", "onnxruntime", "torch"])
    choice = resolve_backend(load_launch(launch))
    assert choice.backend == "onnxruntime" and choice.recipe == "fp32"
    assert [s.split(":")[0] for s in choice.skipped] == ["tensorrt", "cudagraph"]
    lone = onnxruntime_launch(tmp_path, backend="tensorrt")
    with pytest.raises(ConfigError, match="none can run here"):
        resolve_backend(load_launch(lone))


def test_a_configuration_the_engines_do_not_cover_falls_back_with_its_reason(tmp_path):
    launch = onnxruntime_launch(tmp_path, fallback=["torch"], vision_frames=2)
    choice = resolve_backend(load_launch(launch))
    assert choice.backend == "torch" and "vision_frames = 2" in choice.skipped[0]


@pytest.mark.slow
def test_calibrate_then_int8_trt_engines_and_a_new_calibration_rebuilds(tmp_path, capsys):
    """`vla-node calibrate` on a synthetic drive writes calib/<model>/; the int8-trt engines build from it (Q/DQ,
    zero points 0) and run in the node's policy; a calibration made from other frames changes the engines' keys:
    they are rebuilt."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from vla_node.drives.convert import convert_synthetic
    from vla_node.drives.synthetic import SyntheticDriveConfig

    drives = []
    for seed in (0, 1):
        drive = tmp_path / f"synthetic-{seed}.mcap"
        convert_synthetic(SyntheticDriveConfig(width=64, height=48, fps=10, seconds=1.2, seed=seed), drive,
                          progress=False)
        drives.append(drive)
    launch = onnxruntime_launch(tmp_path, recipe="int8-trt", calibration=str(tmp_path / "calib"))
    assert main(["calibrate", "--launch", str(launch), "--drive", str(drives[0]), "--frames-max", "12"]) == 0
    assert "wrote" in capsys.readouterr().out
    (folder,) = (tmp_path / "calib").iterdir()
    files = {p.name for p in folder.iterdir()}
    assert {"manifest.json", "ranges.json", "weights.json", "tick.npz", "text.npz"} <= files
    config = load_launch(launch)
    pipeline = Pipeline(config, warm_up_rounds=1)
    assert (pipeline.backend.backend, pipeline.backend.recipe) == ("onnxruntime", "int8-trt")
    tick = next(p for p in (tmp_path / "engines").iterdir() if p.name.startswith("tick-int8-trt"))
    graph = onnx.load(str(tick / "tick.onnx"))
    zero_points = [numpy_helper.to_array(t) for t in graph.graph.initializer if t.name.endswith("zero_point")]
    assert zero_points and all(z.dtype == np.int8 and not z.any() for z in zero_points)
    first = {p.name for p in (tmp_path / "engines").iterdir()}
    assert main(["calibrate", "--launch", str(launch), "--drive", str(drives[1]), "--frames-max", "12"]) == 0
    Pipeline(config, warm_up_rounds=1)
    rebuilt = {p.name for p in (tmp_path / "engines").iterdir()} - first
    assert any(name.startswith("tick-int8-trt") for name in rebuilt), rebuilt


def test_the_shipped_calibration_set_is_the_tiny_test_models():
    """calib/ ships the set `vla-node calibrate --launch tests/launch/tiny.toml` makes from the synthetic drive;
    it reads and checks (hashes) against that model."""
    from helpers.paths import REPO_ROOT
    from vla_node.backends.calibration import find_calibration
    from vla_node.backends.loading import load_model

    section = load_launch(TINY_LAUNCH).model
    model = load_model(section.model_config(), "plain", seed=section.seed)
    data = find_calibration(REPO_ROOT / "calib", model)
    assert data.count("tick") > 0 and data.digest


def test_every_engine_folder_keeps_its_onnx_sidecar_and_polygraphy_files(tmp_path):
    """What a TensorRT machine needs to check an engine against the same references: the graph, its sidecar
    (bindings, opset, versions, parity) and polygraphy's input/output files, readable by polygraphy itself."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    launch = onnxruntime_launch(tmp_path)
    assert main(["build-engines", "--launch", str(launch)]) == 0
    folders = [p for p in (tmp_path / "engines").iterdir() if p.is_dir() and p.name != EXPORTS]
    assert {p.name.split("-fp32-")[0] for p in folders} >= {"text", "tick", "tower-4", "decoder-tick-4-a"}
    for folder in folders:
        step = folder.name.split("-fp32-")[0]
        sidecar = json.loads((folder / f"{step}.json").read_text())
        assert sidecar["opset"] <= 20 and sidecar["recipe"] == {"recipe": "fp32"}
        assert all(f["max_rel"] <= 1e-4 for f in sidecar["parity_onnxruntime_vs_torch"].values()), step
        feeds = load_json(str(folder / "inputs.json"))
        assert [sorted(feeds[0])] == [sorted(i["name"] for i in sidecar["inputs"])]
        results = RunResults.load(str(folder / "outputs.json"))
        assert sorted(results[0][1][0]) == sorted(o["name"] for o in sidecar["outputs"])


def test_degrade_by_precision_runs_the_int8_recipe_of_the_same_model(tmp_path):
    """scheduler.smaller_recipe: the smaller_engine level runs the same model's int8-ort engines."""
    launch = onnxruntime_launch(tmp_path)
    launch.write_text(launch.read_text().replace("[scheduler]\n", '[scheduler]\nsmaller_recipe = "int8-ort"\n', 1))
    pipeline = Pipeline(load_launch(launch), warm_up_rounds=1)
    assert pipeline.small.engines.recipe == "int8-ort" and pipeline.policy.engines.recipe == "fp32"
    assert any(level.knobs.use_smaller_engine for level in pipeline.scheduler.levels)


@pytest.mark.parametrize("line, message", [
    ('backend = "onnx"', "model.backend"),
    ('fallback = ["torch", "tensor-rt"]', "model.fallback"),
    ('recipe = "int4"', "model.recipe"),
])
def test_a_bad_backend_recipe_or_fallback_is_named_at_load(tmp_path, line, message):
    path = tmp_path / "bad.toml"
    path.write_text(TINY_LAUNCH.read_text().replace("[model]\n", f"[model]\n{line}\n", 1))
    with pytest.raises(ConfigError, match=message):
        load_launch(path)


def test_a_smaller_engine_is_a_preset_or_a_recipe_not_both(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text(TINY_LAUNCH.read_text().replace(
        "[scheduler]\n", '[scheduler]\nsmaller_preset = "tiny"\nsmaller_recipe = "int8-ort"\n', 1))
    with pytest.raises(ConfigError, match="smaller_recipe"):
        load_launch(path)
