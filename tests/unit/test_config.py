"""Launch files: real TOML, every key commented, bad values fail at load naming key, value and what is allowed."""

import re
from pathlib import Path

import pytest

from vla_node.config import LAUNCH_DIR, NodeConfig, load_launch
from vla_node.validate import ConfigError, from_dict

LAUNCH_FILES = sorted(LAUNCH_DIR.glob("*.toml"))


def test_the_three_platform_launch_files_exist():
    assert {p.name for p in LAUNCH_FILES} >= {"cpu.toml", "rtx.toml", "jetson-orin.toml"}


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_file_loads_and_every_key_is_commented(path):
    config = load_launch(path)
    assert isinstance(config, NodeConfig)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if re.match(r"^\s*[A-Za-z_]+\s*=", line):  # a key = value line
            assert "#" in line, f"{path.name}:{number} has no comment: {line!r}"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "launch.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("[model]\npreset = 'smal'\n", "model.preset = 'smal': expected one of ['base', 'small', 'tiny'] (did you mean 'small'?)"),
    ("[model]\npresett = 'small'\n", "model.presett: unknown key"),
    ("[scheduler]\ncontrol_hz = -5\n", "scheduler.control_hz = -5"),
    ("[scheduler]\ncontrol_hz = 'fast'\n", "scheduler.control_hz = 'fast': expected a number"),
    ("[cache]\nattention = 'flash'\n", "cache.attention = 'flash'"),
    ("[cache.vision]\npolicy = 'lru'\n", "policy = 'lru'"),
    ("[reuse]\nthreshold = -1.0\n", "reuse.threshold = -1.0"),
    ("[transport]\nactions = 'tcp://0.0.0.0:5562'\n", "transport.actions = 'tcp://0.0.0.0:5562'"),
    ("[[cameras]]\nname = 'front'\n[[cameras]]\nname = 'front'\n", "cameras = ['front', 'front']"),
    ("[scheduler]\nfallback_action = [0.0]\n", "scheduler.fallback_action = (0.0,): expected 2 values"),
    ("[scheduler]\nfallback_hold = [true]\n", "scheduler.fallback_hold = (True,): expected 2 values"),
    ("[scheduler]\nfallback_hold = [1, 0]\n", "scheduler.fallback_hold[0] = 1: expected true or false"),
    ("[model]\ndevice = 'tpu'\n", "model.device = 'tpu'"),
    ("[model]\npreset = 'tiny'\ninstruction = 'keep the lane and follow traffic'\n",
     "model.instruction = 'keep the lane and follow traffic': expected at most 23 UTF-8 bytes"),
    ("[model\npreset = 'small'\n", "invalid TOML"),
    ("[scheduler]\nsmaller_preset = 'tinyy'\n", "scheduler.smaller_preset = 'tinyy': expected one of"),
    ("[health]\nperiod_s = inf\n", "health.period_s = inf: expected a finite number > 0"),
    ("[realtime]\nworker_nice = 25\n", "realtime.worker_nice = 25: expected an integer in [0, 19]"),
    ("[model]\nthreads = 'two'\n", "model.threads = 'two': expected an integer >= 0 or 'auto'"),
    ("[model]\nthreads = -1\n", "model.threads = -1: expected an integer >= 0 or 'auto'"),
    # checked against the model's window (tiny: 1 frame of 4 tokens) when the file loads, not at node start
    ("[model]\npreset = 'tiny'\n[cache.vision]\ncapacity_tokens = 1\n",
     "cache.vision.capacity_tokens = 1: expected >= 4 for policy 'fifo'"),
    ("[model]\npreset = 'tiny'\n[cache.vision]\npolicy = 'tiered'\n",
     "cache.vision.window_frames = 1: expected at least 2 with policy 'tiered'"),
])
def test_bad_values_fail_at_load_with_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_launch(write(tmp_path, text))
    assert message in str(info.value)
    assert str(tmp_path / "launch.toml") in str(info.value)


def test_missing_launch_file():
    with pytest.raises(ConfigError, match="launch file not found"):
        load_launch("/nonexistent/launch.toml")


def test_non_loopback_needs_an_explicit_setting(tmp_path):
    config = load_launch(write(tmp_path, "[transport]\nallow_non_loopback = true\nactions = 'tcp://0.0.0.0:5562'\n"))
    assert config.transport.actions == "tcp://0.0.0.0:5562"


def test_a_window_above_the_presets_rebuilds_the_position_table(tmp_path):
    """model.vision_frames moves the state and query slots further out: RoPE must cover their positions."""
    from vla_node.node.pipeline import Pipeline

    config = load_launch(write(tmp_path, "[model]\npreset = 'tiny'\ninstruction = 'go'\nvision_frames = 3\n"
                                         "dtype = 'fp32'\nweights = 'fp32'\n"))
    pipeline = Pipeline(config, warm_up_rounds=1)  # every stage on the new layout (it indexed past the old table)
    model = pipeline.policy.model
    assert model.config.vision_frames == 3 and model.decoder.rope.cos.shape[0] == model.config.max_positions


def test_set_overrides_change_values_and_are_checked_like_the_file():
    from vla_node.config import parse_override

    config = load_launch(LAUNCH_DIR / "cpu.toml", ["reuse.threshold=4", "cache.vision.storage_dtype=fp32",
                                                   "model.preset=tiny", "model.instruction=keep the lane",
                                                   "scheduler.fallback_action=[0.0, -0.5]"])
    assert config.reuse.threshold == 4.0 and config.cache.vision.storage_dtype == "fp32"
    assert config.model.preset == "tiny" and config.model.instruction == "keep the lane"
    assert config.scheduler.fallback_action == (0.0, -0.5)
    assert load_launch(LAUNCH_DIR / "cpu.toml").model.threads == "auto"  # node/realtime.py resolves it at start
    assert load_launch(LAUNCH_DIR / "cpu.toml", ["model.threads=2"]).model.threads == 2
    assert parse_override("model.checkpoint=ckpt/tiny-bins") == (("model", "checkpoint"), "ckpt/tiny-bins")
    assert parse_override('model.checkpoint="a=b"') == (("model", "checkpoint"), "a=b")
    with pytest.raises(ConfigError, match=r"with --set reuse.thresold=4: reuse.thresold: unknown key.*'threshold'"):
        load_launch(LAUNCH_DIR / "cpu.toml", ["reuse.thresold=4"])
    with pytest.raises(ConfigError, match=r"reuse.threshold = -1.0"):
        load_launch(LAUNCH_DIR / "cpu.toml", ["reuse.threshold=-1"])
    for bad in ("threshold=4", "reuse.threshold", "cameras.name=rear"):
        with pytest.raises(ConfigError, match=r"--set = "):
            load_launch(LAUNCH_DIR / "cpu.toml", [bad])


def test_a_forced_level_is_checked_against_the_nodes_levels_at_load(tmp_path):
    ok = load_launch(write(tmp_path, "[model]\npreset = 'tiny'\ninstruction = 'go'\n[scheduler]\n"
                                     "min_level = 'skip_vision'\n"))
    assert ok.scheduler.min_level == "skip_vision"
    with pytest.raises(ConfigError, match=r"scheduler.min_level = 'fewer_denoising_steps 5'.*one of \['normal'"):
        load_launch(write(tmp_path, "[model]\npreset = 'tiny'\ninstruction = 'go'\n[scheduler]\n"
                                    "min_level = 'fewer_denoising_steps 5'\n"))
    flow = load_launch(write(tmp_path, "[model]\npreset = 'tiny'\naction_head = 'flow'\ninstruction = 'go'\n"
                                       "[scheduler]\nmin_level = 'fewer_denoising_steps 5'\n"))
    assert flow.scheduler.min_level == "fewer_denoising_steps 5"


@pytest.mark.parametrize("table, match", [
    ({"listen": "0.0.0.0:9464"}, "metrics.listen = '0.0.0.0:9464': expected a loopback address"),
    ({"listen": "9464"}, "HOST:PORT"),
    ({"listen": "127.0.0.1:99999"}, "port in"),
    ({"allow_non_loopback": "yes"}, "true or false"),
])
def test_the_metrics_section_is_checked(table, match):
    from vla_node.config import MetricsConfig
    with pytest.raises(ConfigError, match=match):
        from_dict(MetricsConfig, table, "metrics")
    assert from_dict(MetricsConfig, {"listen": "[::1]:9464"}).host_port() == ("::1", 9464)
    assert from_dict(MetricsConfig, {"listen": "10.1.2.3:9464", "allow_non_loopback": True}).listen
