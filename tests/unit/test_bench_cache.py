"""`vla-node bench cache` end to end on the tiny preset: every figure the issue names is there, measured in one run,
with the weights each compute dtype gets by default; the flow head's section (its tick by step count, the reference,
the accuracy of fewer steps)."""

import json

import numpy as np
import pytest
import torch

from vla_node.backends.fp16_weights import fp16_weights_available
from vla_node.backends.packed_weights import packed_weights_available
from vla_node.bench import cache as bench_cache
from vla_node.model.config import preset
from vla_node.model.vla import build_vla
from vla_node.sched.scheduler import SchedulerConfig
from vla_node.validate import ConfigError

KEYS = ("action_tick_ms", "action_tick_after_commit_ms", "vision_update_ms", "vision_update_with_tick_ms",
        "text_update_ms", "reference_step_ms", "hf_generate_ms", "kv_bytes", "vision_kv_bytes_fp16_equivalent")
FLOW_KEYS = ("flow_tick_ms", "flow_tick_ms_by_steps", "flow_per_step_ms", "flow_fixed_ms", "reference_flow_ms",
             "reference_vision_tower_ms", "reference_flow_without_vision_ms", "reference_over_flow_tick",
             "flow_tick_over_bins_tick", "targets", "fewer_steps_accuracy")


def _run(tmp_path, compute_dtype):
    path = tmp_path / "cache.json"
    result = bench_cache.run("tiny", iters=1, json_path=str(path), compute_dtype=compute_dtype, deviation_frames=2,
                             policy_frames=2)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    for key in KEYS:
        assert key in result, key
    assert set(result["kv_bytes"]) == {"text", "vision", "action"}
    assert all(result[key] > 0 for key in KEYS if key.endswith("_ms"))
    for row in result["vision_policies"]:  # vision + tick: the same work in every row
        assert row["step_ms"] > 0 and row["step_ms"] >= min(row["vision_update_ms"], row["action_tick_ms"])
    # the target's frame is the fused stage; the same work as two stages is reported beside it
    assert result["hf_generate_over_vision_update_plus_action_tick"] == round(
        result["hf_generate_ms"] / result["vision_update_with_tick_ms"], 2)
    assert result["hf_generate_over_separate_vision_update_and_tick"] == round(
        result["hf_generate_ms"] / (result["vision_update_ms"] + result["action_tick_after_commit_ms"]), 2)
    for key, target in result["targets"].items():
        assert target["met"] == (result[key] >= target["target"])
        rounds = target["per_round"]
        assert rounds["min"] <= rounds["median"] <= rounds["max"] and rounds["rounds"] == 1
        assert rounds["met_rounds"] == (rounds["median"] >= target["target"])  # one round: its ratio is the median
    _check_flow(result)
    return result


def _check_flow(result):
    """The flow section: the tick at 10 steps and at each fewer_denoising_steps level, the reference in the same
    rounds, the target, and the fewer steps' deviation from the 10-step chunks."""
    flow = result["flow"]
    for key in FLOW_KEYS:
        assert key in flow, key
    levels = (10, *SchedulerConfig().denoising_steps)
    by_steps = flow["flow_tick_ms_by_steps"]
    assert list(by_steps) == [str(n) for n in levels] and all(ms > 0 for ms in by_steps.values())
    assert flow["flow_tick_ms"] == by_steps["10"] and flow["reference_flow_ms"] > 0
    assert abs(flow["flow_per_step_ms"] - (by_steps["10"] - by_steps[str(levels[-1])]) / (10 - levels[-1])) < 0.01
    assert flow["reference_over_flow_tick"] == round(flow["reference_flow_ms"] / flow["flow_tick_ms"], 2)
    assert flow["flow_tick_over_bins_tick"] == round(flow["flow_tick_ms"] / result["action_tick_ms"], 2)
    assert flow["expert_linear_layer"] == "Linear"  # plain whatever the trunk's weights (guidance differentiates it)
    (key, target), = flow["targets"].items()
    assert (key, target["target"]) == ("reference_over_flow_tick", 5.0)
    assert target["met"] == (flow[key] >= 5.0) and target["per_round"]["rounds"] == 1
    accuracy = flow["fewer_steps_accuracy"]
    assert accuracy["frames"] == 2 and accuracy["finite"] and accuracy["baseline_steps"] == 10
    assert accuracy["frames_source"] in ("real clip", "synthetic drive (no real clip found)")
    assert list(accuracy["by_steps"]) == [str(n) for n in levels[1:]]
    for d in accuracy["by_steps"].values():
        assert 0 <= d["mean_abs"] <= d["max_abs"] < np.inf
        assert d["max_abs_over_rms"] == pytest.approx(d["max_abs"] / accuracy["baseline_rms"])


def test_per_round_ratio_sums_each_rounds_cases():
    timing = {"a": {"samples": [10.0, 30.0, 20.0]}, "b": {"samples": [1.0, 2.0, 4.0]},
              "c": {"samples": [1.0, 1.0, 1.0]}}
    ratios = bench_cache.per_round_ratio(timing, ("a",), ("b", "c"), target=5.0)  # 10/2, 30/3, 20/5
    assert ratios == {"min": 4.0, "median": 5.0, "max": 10.0, "met_rounds": 2, "rounds": 3}


@pytest.mark.skipif(not fp16_weights_available(), reason="fbgemm (x86-64) is not in this torch")
def test_fp32_compute_times_fp16_weights_against_plain_fp32_ones(tmp_path):
    result = _run(tmp_path, "fp32")
    assert (result["weights"], result["hf_weights"], result["plain_weights"]["weights"]) == ("fp16", "fp16", "fp32")
    assert result["linear_layers"] == {"policy": "Fp16WeightLinear", "reference": "Fp16WeightLinear",
                                       "plain weights": "Linear"}  # what really ran, not the labels


@pytest.mark.skipif(not packed_weights_available(),
                    reason="packed bf16 weights need oneDNN running bf16 in hardware (AVX512-BF16 or AMX, as "
                           "ONEDNN_MAX_CPU_ISA allows)")
def test_bf16_compute_times_packed_weights_against_plain_bf16_ones_and_transformers_unpacked(tmp_path):
    result = _run(tmp_path, "bf16")
    assert (result["weights"], result["hf_weights"], result["plain_weights"]["weights"]) == ("packed", "bf16", "bf16")
    assert result["reference_dtype"] == result["hf_dtype"] == "bf16"
    assert result["linear_layers"] == {"policy": "PackedLinear", "reference": "PackedLinear", "plain weights": "Linear"}


def test_fewer_steps_deviate_from_the_full_steps_chunk_of_the_same_noise():
    """Policies in lockstep draw the same noise per tick: the same step count deviates by exactly nothing, fewer
    steps by something."""
    model = build_vla(preset("tiny", "flow"), seed=0)
    frames, states = bench_cache.drive_frames(2), bench_cache.ego_states(2, model.config.state_dim)
    d = bench_cache.flow_steps_deviation(model, torch.float32, frames, states, full=3, fewer=(3, 1))
    assert d["by_steps"]["3"] == {key: 0.0 for key in d["by_steps"]["3"]}
    assert d["by_steps"]["1"]["max_abs"] > 0 and d["baseline_rms"] > 0 and d["frames"] == 2


def test_the_accuracy_frames_are_the_real_clip_where_found_else_synthetic(monkeypatch, tmp_path):
    from vla_node.bench.clips import default_clip

    if default_clip() is not None:
        frames, source = bench_cache.accuracy_frames(2, 32)
        assert source["frames_source"] == "real clip" and [f.shape for f in frames] == [(32, 32, 3)] * 2
    monkeypatch.setenv("VLA_NODE_DRIVES", str(tmp_path))  # no clip there
    frames, source = bench_cache.accuracy_frames(2, 32)
    assert source == {"frames_source": "synthetic drive (no real clip found)", "clip": None, "fps": 10.0}
    assert [f.shape for f in frames] == [(480, 640, 3)] * 2


def test_weights_that_do_not_fit_the_compute_dtype_are_named():
    with pytest.raises(ConfigError, match="weights = 'packed': expected 'fp32', 'fp16' with fp32 compute"):
        bench_cache.run("tiny", iters=1, compute_dtype="fp32", weights="packed")


def test_a_bench_refuses_the_flags_it_does_not_take(capsys):
    from vla_node.cli import main

    for argv, flag in ((["bench", "node", "--iters", "3"], "--iters"), (["bench", "model", "--weights", "fp16"],
                                                                          "--weights")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_bench_reuse_takes_every_flag_of_its_run_function(monkeypatch):
    """Every keyword of bench.reuse.run is a flag (the defaults are the function's own, written once)."""
    import inspect

    from vla_node.bench import reuse
    from vla_node.cli import build_parser

    params = set(inspect.signature(reuse.run).parameters)
    calls = []
    monkeypatch.setattr(reuse, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    args = build_parser().parse_args(["bench", "reuse", "a.mp4", "--thresholds", "1", "3", "--rates", "native", "5",
                                      "--max-frames", "4", "--cache", "exact", "--pixel-floor", "--weights", "fp32",
                                      "--layer-budget", "1.5", "--shared-drift-samples", "2", "--max-age", "3",
                                      "--threads", "1", "--preset", "tiny", "--json", "out.json"])
    args.func(args)
    (positional, kwargs), = calls
    assert positional == (["a.mp4"],)
    assert kwargs == {"preset": "tiny", "json_path": "out.json", "thresholds": [1.0, 3.0], "rates": ["native", 5.0],
                      "max_frames": 4, "cache": "exact", "pixel_floor": True, "weights": "fp32", "layer_budget": 1.5,
                      "shared_drift_samples": 2, "max_age": 3, "threads": 1}
    assert params - set(kwargs) == {"drives", "seed", "progress"}, params - set(kwargs)


def test_bench_model_runs_on_a_preset_with_a_short_text_partition(tmp_path):
    """tiny's text partition holds 23 bytes: bench model takes an instruction that fits it."""
    from vla_node.bench import model as bench_model

    result = bench_model.run("tiny", iters=1, iters_bf16=1, json_path=str(tmp_path / "model.json"))
    assert all(result[key] > 0 for key in ("reference_fp32_ms", "reference_bf16_ms", "hf_generate_ms"))


def test_a_benchs_preset_and_json_go_before_or_after_its_name_and_its_defaults_stay_its_own(monkeypatch, capsys):
    from vla_node.bench import model
    from vla_node.cli import build_parser, main

    calls = []
    monkeypatch.setattr(model, "run", lambda **kwargs: calls.append(kwargs))
    for argv in (["bench", "--preset", "tiny", "--json", "m.json", "model"],
                 ["bench", "model", "--preset", "tiny", "--json", "m.json"]):
        args = build_parser().parse_args(argv)
        args.func(args)
    args = build_parser().parse_args(["bench", "model"])
    args.func(args)
    assert calls == [{"preset_name": "tiny", "json_path": "m.json"}] * 2 + [{}]
    assert main(["bench", "attention", "--preset", "tiny"]) == 2
    assert "bench attention: --preset does not apply" in capsys.readouterr().err
