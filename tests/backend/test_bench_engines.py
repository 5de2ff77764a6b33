"""`vla-node bench engines` on the tiny preset: every step the engine policy runs, each recipe timed in one run,
ONNX Runtime fp32 equal to torch fp32, the int8 recipe's deviation reported, the eager default frame timed beside
them, the targets computed from the same run's figures, the node's RSS per backend; the flow tick beside the bins
tick (at 2 and 1 Euler steps here: the exports' cost grows with the steps), its per-step figure from the same run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime runs the exported steps")


@pytest.mark.slow
def test_bench_engines_times_every_step_and_recipe_side_by_side(tmp_path, capsys):
    from vla_node.bench import engines
    from vla_node.model.config import preset

    result = engines.run("tiny", iters=1, json_path=str(tmp_path / "engines.json"), flow_steps=(2, 1))
    assert json.loads((tmp_path / "engines.json").read_text()) == result
    assert set(result["steps"]) == set(engines.bench_steps(preset("tiny")))
    for step, recipes in result["steps"].items():
        assert {"torch-fp32", "onnxruntime-fp32", "onnxruntime-int8"} <= set(recipes), step
        assert all(f["ms"] > 0 for f in recipes.values()), step
        for output, figures in recipes["onnxruntime-fp32"]["parity_vs_torch_fp32"].items():
            assert figures["max_rel"] <= 1e-4, (step, output, figures)
        for output, figures in recipes["onnxruntime-int8"]["parity_vs_torch_fp32"].items():
            assert figures["max_rel"] < 0.5, (step, output, figures)  # quantized: off, but not garbage
    assert result["eager_default_frame_ms"] > 0
    assert set(result["rss_mb"]) == {"torch", "onnxruntime"} and all(v > 0 for v in result["rss_mb"].values())
    targets = result["targets"]
    tick = result["steps"]["tick"]
    ratio = targets["onnxruntime_int8_tick_over_torch_fp32_tick"]["value"]
    assert ratio == pytest.approx(tick["onnxruntime-int8"]["ms"] / tick["torch-fp32"]["ms"], abs=1e-3)
    best = targets["best_frame_and_tick_over_default"]
    frame = targets["frame_and_tick_ms"][best["best"]]
    assert best["value"] == pytest.approx(frame / result["eager_default_frame_ms"], abs=1e-3)
    flow = result["flow"]
    assert flow["counts"] == [2, 1] and set(flow["steps"]) == {"flow-tick-2", "flow-tick-1"}
    for step, recipes in flow["steps"].items():
        assert set(recipes) == set(tick) and all(f["ms"] > 0 for f in recipes.values()), step
        for output, figures in recipes["onnxruntime-fp32"]["parity_vs_torch_fp32"].items():
            assert figures["max_rel"] <= 1e-4, (step, output, figures)
        assert set(recipes["torch-fp32"]["parity_vs_torch_fp32"]) == {"chunk", "state_k", "state_v"}
    for recipe in tick:
        high, low = flow["steps"]["flow-tick-2"][recipe]["ms"], flow["steps"]["flow-tick-1"][recipe]["ms"]
        assert flow["flow_tick_ms"][recipe] == high
        assert flow["flow_per_step_ms"][recipe] == pytest.approx(high - low, abs=1e-3)
        assert flow["flow_over_bins_tick"][recipe] == pytest.approx(high / tick[recipe]["ms"], abs=1e-3)
    out = capsys.readouterr().out
    assert "onnxruntime-int8 tick / torch-fp32 tick" in out and "node RSS after warm-up" in out
    assert "flow tick, 2 steps" in out
