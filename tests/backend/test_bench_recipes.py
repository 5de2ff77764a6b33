"""`vla-node bench recipes` on the tiny preset and a short mp4: every recipe's accuracy against the torch steps in
one run (int8-trt calibrated first), the fp32 graphs equal to the torch steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.clips import write_mp4

pytest.importorskip("onnxruntime", reason="onnxruntime runs the exported steps")


@pytest.mark.slow
def test_bench_recipes_reports_every_recipe_against_the_torch_steps(tmp_path, capsys):
    from vla_node.bench import recipes

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    frames = [np.roll(base, shift, axis=1) for shift in range(8)]  # a scene panning by a pixel a frame
    clip = tmp_path / "pan.mp4"
    write_mp4(clip, frames)
    result = recipes.run([str(clip)], preset="tiny", max_frames=4, calibration_frames=6,
                         json_path=str(tmp_path / "recipes.json"))
    assert json.loads((tmp_path / "recipes.json").read_text()) == result
    figures = result["drives"]["pan.mp4"]["recipes"]
    assert set(figures) == {"torch-fp32", "onnxruntime-fp32", "onnxruntime-int8-ort", "onnxruntime-int8-trt"}
    assert figures["torch-fp32"]["logit_err_max"] == 0 and figures["torch-fp32"]["bins_equal"] == 1
    assert figures["onnxruntime-fp32"]["logit_err_max"] < 1e-4
    for recipe in ("onnxruntime-int8-ort", "onnxruntime-int8-trt"):
        assert 0 < figures[recipe]["logit_err_max"] < 0.25, recipe
    assert "bench recipes: tiny" in capsys.readouterr().out
