"""The engine store: a change of weights, recipe, calibration or runtime version is another engine; a corrupt or
truncated file is rebuilt, or with building refused a one-line error naming the command; a failed build leaves
nothing behind."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vla_node.backends.store import EngineKey, EngineStore, EngineStoreError, device_description, weights_digest

BUILD = "vla-node build-engines --launch launch/cpu.toml"


def key(**changes) -> EngineKey:
    base = EngineKey(step="tick", recipe="fp32", backend="onnxruntime", backend_version="1.32.0", device="cpu x",
                     weights="w0", shapes=(("bias", (3, 4)),), calibration=None)
    return dataclasses.replace(base, **changes)


class Builder:
    """Counts builds; writes an engine file (or fails on request)."""

    def __init__(self) -> None:
        self.builds = 0

    def __call__(self, folder) -> None:
        self.builds += 1
        (folder / "tick.onnx").write_bytes(b"engine bytes %d" % self.builds)


def test_an_engine_is_built_once_and_found_again(tmp_path):
    store, build = EngineStore(tmp_path), Builder()
    folder = store.get(key(), build, BUILD)
    assert (folder / "tick.onnx").is_file() and (folder / "manifest.json").is_file() and build.builds == 1
    assert store.get(key(), build, BUILD) == folder and build.builds == 1
    assert store.get(key(), None, BUILD) == folder  # built: found without building


@pytest.mark.parametrize("change", [{"weights": "w1"}, {"recipe": "int8-ort"}, {"calibration": "c1"},
                                    {"backend_version": "1.33.0"}, {"device": "cpu y"},
                                    {"shapes": (("bias", (3, 5)),)}])
def test_any_change_of_what_the_engine_depends_on_builds_another(tmp_path, change):
    store, build = EngineStore(tmp_path), Builder()
    first = store.get(key(), build, BUILD)
    other = store.get(key(**change), build, BUILD)
    assert other != first and build.builds == 2
    with pytest.raises(EngineStoreError):
        EngineStore(tmp_path / "empty").get(key(**change), None, BUILD)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_corrupt_engine_is_rebuilt_or_a_one_line_error_without_building(tmp_path, damage):
    store, build = EngineStore(tmp_path), Builder()
    folder = store.get(key(), build, BUILD)
    engine = folder / "tick.onnx"
    if damage == "truncate":
        engine.write_bytes(engine.read_bytes()[:4])
    elif damage == "flip":
        engine.write_bytes(b"X" + engine.read_bytes()[1:])
    elif damage == "delete":
        engine.unlink()
    else:
        (folder / "manifest.json").write_text("{not json")
    with pytest.raises(EngineStoreError) as err:
        store.get(key(), None, BUILD)
    message = str(err.value)
    assert "\n" not in message and BUILD in message and str(folder) in message
    assert store.get(key(), build, BUILD) == folder and build.builds == 2
    assert store.problem(key()) is None


def test_no_build_with_nothing_built_says_what_to_run(tmp_path):
    with pytest.raises(EngineStoreError, match="not built; build it with `vla-node build-engines"):
        EngineStore(tmp_path).get(key(), None, BUILD)


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    def fails(folder):
        (folder / "half.onnx").write_bytes(b"half")
        raise RuntimeError("export failed")

    store = EngineStore(tmp_path)
    with pytest.raises(RuntimeError, match="export failed"):
        store.get(key(), fails, BUILD)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(EngineStoreError, match="wrote no file"):
        store.get(key(), lambda folder: None, BUILD)
    assert list(tmp_path.iterdir()) == []


def test_the_weights_digest_follows_every_value_and_the_device_is_named():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert weights_digest(a) == weights_digest(b)
    with torch.no_grad():
        b.weight[0, 0] += 1e-6
    assert weights_digest(a) != weights_digest(b)
    assert "oneDNN" in device_description("cpu")
