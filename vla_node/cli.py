"""The `vla-node` command. The only place logging is configured.

User errors (bad input files, bad config values) print one line and exit 2; an unexpected exception in
the node is reported with its traceback and exits non-zero so launch restarts the node.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vla_node.validate import ConfigError

log = logging.getLogger("vla_node")


def cmd_init(args) -> int:
    from vla_node.model.checkpoint import save_checkpoint
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla

    model = build_vla(preset(args.preset, args.action_head), seed=args.seed)
    path = save_checkpoint(model, args.out)
    n = sum(p.numel() for p in model.parameters())
    expert = "" if model.expert is None else \
        f", of which the flow head's action expert {sum(p.numel() for p in model.expert.parameters()) / 1e6:.1f} M"
    print(f"wrote {args.preset} checkpoint ({args.action_head} head, seed {args.seed}, {n / 1e6:.1f} M parameters"
          f"{expert}) to {path}")
    return 0


def given(args, *names: str) -> dict:
    """The flags the user gave (not None), as keyword arguments: every default is the called function's own."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def bench_kwargs(args, preset_keyword: str | None, *names: str, no_preset: str = "it times fixed shapes") -> dict:
    """The benchmark's keyword arguments from the flags given (--preset and --json before or after its name);
    no_preset: why --preset does not apply, for a benchmark without a preset keyword."""
    kwargs = given(args, "json_path", *names)
    if getattr(args, "preset", None) is not None:
        if preset_keyword is None:
            raise ConfigError(f"bench {args.what}: --preset does not apply ({no_preset})")
        kwargs[preset_keyword] = args.preset
    return kwargs


def cmd_bench(args) -> int:
    if args.what == "model":
        from vla_node.bench import model

        model.run(**bench_kwargs(args, "preset_name", "iters", "threads"))
    elif args.what == "cache":
        from vla_node.bench import cache

        cache.run(**bench_kwargs(args, "preset_name", "iters", "threads", "compute_dtype", "weights"))
    elif args.what == "node":
        from vla_node.bench import node

        node.run(**bench_kwargs(args, "preset", "seconds", "launch"))
    elif args.what == "engines":
        from vla_node.bench import engines

        engines.run(**bench_kwargs(args, "preset_name", "iters", "threads"))
    elif args.what == "recipes":
        from vla_node.bench import recipes

        recipes.run(args.drives, **bench_kwargs(args, "preset", "max_frames", "calibration_frames"))
    elif args.what == "attention":
        from vla_node.bench import attention

        attention.run(**bench_kwargs(args, None, "threads"))
    elif args.what == "soak":
        from vla_node.bench import soak

        soak.run(**bench_kwargs(args, "preset", "minutes", "cameras", "launch", "control_hz", "encoding", "out_dir"))
    elif args.what == "all":
        from vla_node.bench import suite

        if getattr(args, "json_path", None) is not None:
            raise ConfigError("bench all: --json does not apply (it writes DIR/bench.json; see --out)")
        suite.run(**bench_kwargs(args, "preset", "out_dir", "drive", "launch", "frames", "threads", "quick"))
    elif args.what == "closed-loop":
        from vla_node.bench import closed_loop

        kwargs = bench_kwargs(args, None, "checkpoints", "minutes", "out_dir",
                              no_preset="it drives tiny checkpoints: --checkpoints")
        for name in ("seeds", "heads", "only"):
            if getattr(args, name, None):
                kwargs[name] = tuple(getattr(args, name))
        closed_loop.run(**kwargs)
    else:
        from vla_node.bench import reuse

        reuse.run(args.drives, **bench_kwargs(args, "preset", "thresholds", "rates", "max_frames", "cache",
                                               "pixel_floor", "weights", "layer_budget", "shared_drift_samples",
                                               "max_age", "threads"))
    return 0


def cmd_report_compare(args) -> int:
    from vla_node.report.report import compare_reports, load_report

    text, regressed = compare_reports(load_report(args.a), load_report(args.b), args.max_regression)
    print(text)
    return 1 if regressed else 0


def launch_config(args):
    """The launch file with the command line's address overrides applied (validated again)."""
    import dataclasses

    from vla_node.config import default_launch, load_launch

    config = load_launch(args.launch or default_launch(), getattr(args, "set", None) or ())
    overrides = addresses(args)
    if overrides:
        config = config.replace(transport=dataclasses.replace(config.transport, **overrides))
    return config


def cmd_run(args) -> int:
    import dataclasses

    from vla_node.node.node import Node

    config = launch_config(args)
    if args.no_build:
        config = config.replace(model=dataclasses.replace(config.model, build_engines=False))
    return Node(config).run()


def cmd_build_engines(args) -> int:
    """Export, quantize, check and store every engine the launch file's node runs (and its smaller engine's)."""
    import dataclasses

    from vla_node.config import load_launch
    from vla_node.node.policies import build_launch_engines

    config = load_launch(args.launch)
    section = dataclasses.replace(config.model, **given(args, "backend", "recipe"))
    if section.backend == "torch" and not section.resolved_compiled_tick:
        raise ConfigError("backend 'torch' runs the eager policy: no engines to build unless its tick is compiled "
                          "(model.compiled_tick); pass --backend onnxruntime, tensorrt or cudagraph")
    build_launch_engines(config.replace(model=dataclasses.replace(section, fallback=())), args.launch,
                         progress=lambda line: print(line, flush=True))
    return 0


def cmd_calibrate(args) -> int:
    from pathlib import Path

    from vla_node.config import load_launch
    from vla_node.drives.calibrate import calibrate, drive_images, folder_images

    config = load_launch(args.launch)
    cameras = config.model.model_config().num_cameras
    if args.drive:
        source, images = args.drive, drive_images(Path(args.drive), cameras, args.frames_max)
    else:
        folder = Path(args.frames)
        if not folder.is_dir():
            raise ConfigError(f"--frames {folder}: not a folder of images")
        source, images = args.frames, folder_images(folder, cameras, args.frames_max)
    calibrate(config, images, source, args.frames_max, progress=lambda line: print(line, flush=True))
    return 0


def cmd_keys(args) -> int:
    from vla_node.wire.keys import create_keys

    paths = create_keys(args.out)
    print(f"wrote CURVE keys to {args.out}: {paths}")
    return 0


def cmd_convert(args) -> int:
    from vla_node.drives.convert import convert_video

    size = parse_size(args.size) if args.size else None
    summary = convert_video(args.video, args.out, fps=args.fps, size=size, encoding=args.encoding, camera=args.camera)
    print(f"wrote {args.out}: {summary.frames} frames, {summary.duration_s:.2f} s, {summary.bytes / 1e6:.1f} MB")
    return 0


def cmd_replay(args) -> int:
    from vla_node.drives.replay import replay

    replay(args.drive, args.launch, connect=args.connect, rate=args.rate, as_fast_as_possible=args.as_fast_as_possible,
           loop=args.loop, topic=args.topic, out_dir=args.out, progress=not args.no_progress,
           addresses=addresses(args), overrides=tuple(args.set or ()), record_out=args.record_out,
           **given(args, "warmup_timeout_s"))
    return 0


def cmd_record(args) -> int:
    from vla_node.drives.record import record

    record(args.launch, args.out, args.duration, addresses(args), progress=not args.no_progress)
    return 0


def cmd_view(args) -> int:
    from vla_node.drives.view import view

    view(args.launch, args.port, addresses(args), args.duration, layout_out=args.layout_out,
         progress=not args.no_progress)
    return 0


def _fleet_jobs_args(args) -> dict:
    return dict(rate=args.rate, as_fast_as_possible=args.as_fast_as_possible, repeat=args.repeat,
                resume=args.resume, max_attempts=args.max_attempts, overrides=tuple(args.set or ()),
                progress=not args.no_progress)


def cmd_fleet_run(args) -> int:
    from vla_node.fleet.commands import fleet_run

    report = fleet_run(args.drives, args.launch, args.out, ray_address=args.ray_address, local=args.local,
                       **_fleet_jobs_args(args))
    return 1 if report["fleet"]["failed"] else 0


def cmd_fleet_shard(args) -> int:
    from vla_node.fleet.commands import fleet_shard

    index = args.index
    if index is None:
        env = os.environ.get("JOB_COMPLETION_INDEX")
        if env is None or not env.isdigit():
            raise ConfigError(f"fleet shard: no --index and JOB_COMPLETION_INDEX = {env!r}: expected an integer")
        index = int(env)
    report = fleet_shard(args.drives, args.launch, args.out, index=index, count=args.count, **_fleet_jobs_args(args))
    return 1 if report["fleet"]["failed"] else 0


def cmd_fleet_merge(args) -> int:
    from vla_node.fleet.commands import fleet_merge

    report = fleet_merge(args.dirs, args.out)
    return 1 if report["fleet"]["failed"] else 0


def cmd_fleet_compare(args) -> int:
    from vla_node.fleet.commands import fleet_compare

    return fleet_compare(args.base, args.new, args.max_regression, args.max_action_deviation)


def cmd_demo(args) -> int:
    from vla_node.drives.demo import demo

    demo(args.out, launch=args.launch, progress=not args.no_progress, **given(args, "seconds"))
    return 0


def cmd_fuzz(args) -> int:
    """Fuzz the decoders of outside input for --minutes; print the counts per target; exit 1 on any failure."""
    from vla_node.fuzz.runner import format_summary, run_fuzz
    from vla_node.fuzz.targets import target

    targets = [target(name) for name in args.target] if args.target else None
    summary = run_fuzz(args.minutes, seed=args.seed, targets=targets, out_dir=args.out, progress=not args.no_progress)
    print(format_summary(summary))
    return 0 if summary["ok"] else 1


def cmd_train(args) -> int:
    """Behaviour cloning of the simulator's expert into a checkpoint (resumes a run found in --out)."""
    from vla_node.train.trainer import TrainConfig, train

    config = TrainConfig.for_preset(args.preset, action_head=args.action_head,
                                    **given(args, "steps", "batch_size", "lr", "seed", "episodes", "save_every",
                                            "workers", "threads"))
    state = train(config, args.out, data_dir=args.data, progress=not args.no_progress)
    losses = state["losses"]
    held_out = state["validation"][-1][1] if state["validation"] else None
    print(f"wrote {args.out}: {config.preset} {config.action_head} checkpoint after {state['step']} steps in "
          f"{state['seconds'] / 60:.1f} min"
          + (f"; training loss {losses[0][1]:.4f} -> {losses[-1][1]:.4f}" if losses else "")
          + (f", held-out loss {held_out:.4f}" if held_out is not None else ""))
    if args.evaluate:
        from vla_node.model.checkpoint import load_checkpoint
        from vla_node.train.evaluate import evaluate

        result = evaluate(load_checkpoint(args.out), seeds=tuple(range(args.evaluate)), seconds=120.0,
                          progress=not args.no_progress)
        print("closed loop in process (reference path, 2 min each): " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items() if k != "drives"))
    return 0


def cmd_drive(args) -> int:
    from vla_node.drives.closed_loop import SIM_CHECKPOINTS, drive

    drive(args.checkpoint or SIM_CHECKPOINTS / "bins", args.launch, overrides=tuple(args.set or ()),
          progress=not args.no_progress, **given(args, "minutes", "seed", "out_dir"))
    return 0


def addresses(args) -> dict | None:
    """The command line's address overrides, or None."""
    overrides = {k: getattr(args, k) for k in ("frames", "commands", "actions", "health") if getattr(args, k)}
    return overrides or None


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--size {text!r}: expected WIDTHxHEIGHT, e.g. 640x480") from None
    return w, h


def add_set_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="change one launch-file value for this run (repeatable), e.g. --set reuse.threshold=4 "
                        "--set model.checkpoint=ckpt/tiny")


def add_address_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", help="address the node's frame SUB connects to (overrides the launch file)")
    p.add_argument("--commands", help="address the node's command SUB connects to")
    p.add_argument("--actions", help="address the node's action PUB binds")
    p.add_argument("--health", help="address the node's health PUB binds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vla-node", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_node_commands(sub)
    add_drive_commands(sub)
    add_bench_commands(sub)
    add_fuzz_command(sub)
    add_closed_loop_commands(sub)
    add_fleet_commands(sub)
    return parser


def add_closed_loop_commands(sub) -> None:
    """train, drive."""
    p = sub.add_parser("train", help="behaviour cloning of the road simulator's expert driver into a checkpoint")
    p.add_argument("--preset", default="tiny", help="tiny | small | base (default tiny)")
    p.add_argument("--action-head", default="bins", choices=("bins", "flow"),
                   help="bins (cross-entropy over 256 bins per dim) | flow (the flow-matching loss)")
    p.add_argument("--steps", type=int, help="optimizer steps (default tiny 4000, small 400)")
    p.add_argument("--out", required=True, help="checkpoint directory (a run found there is resumed)")
    p.add_argument("--data", help="dataset folder (default OUT/train/data; both heads of a preset can share one)")
    p.add_argument("--batch-size", type=int, help="samples per step (default tiny 64, small 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default tiny 1e-3, small 3e-4)")
    p.add_argument("--seed", type=int, help="seeds the weights, the dataset and the batches (default 0)")
    p.add_argument("--episodes", type=int, help="simulator episodes in the dataset (default tiny 240, small 40)")
    p.add_argument("--save-every", type=int, help="steps between snapshots (default 500)")
    p.add_argument("--workers", type=int, help="dataset worker processes (default 2)")
    p.add_argument("--threads", type=int, help="torch threads while training (default: every core)")
    p.add_argument("--evaluate", type=int, default=0, metavar="N",
                   help="then drive N simulated 2-minute drives in process (reference path) and print the figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("drive", help="drive the road simulator with a node in real time (closed loop) and report")
    p.add_argument("--checkpoint", help="a checkpoint of `vla-node train` (default checkpoints/tiny/bins, the "
                                        "trained one kept with the code)")
    p.add_argument("--launch", help="launch file (default launch/sim.toml)")
    p.add_argument("--minutes", type=float, help="real (= simulated) minutes (default 2)")
    p.add_argument("--seed", type=int, help="the road (default 0)")
    p.add_argument("--out", dest="out_dir", help="report directory (default out/drive)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_set_option(p)
    p.set_defaults(func=cmd_drive)


def add_node_commands(sub) -> None:
    """init, run, keys, convert."""
    p = sub.add_parser("init", help="write a randomly initialised checkpoint directory")
    p.add_argument("--preset", default="small", help="tiny | small | base")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--action-head", default="bins", choices=("bins", "flow"),
                   help="bins (256 bins per dim, decoded by the decoder) | flow (a flow-matching action expert)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("run", help="run the node")
    p.add_argument("--launch", help="TOML launch file (default launch/cpu.toml)")
    p.add_argument("--no-build", action="store_true",
                   help="refuse to start when an engine is missing or stale (instead of building it)")
    add_set_option(p)
    add_address_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("build-engines", help="export, quantize, check and store the engines a launch file runs")
    p.add_argument("--launch", required=True, help="TOML launch file")
    p.add_argument("--backend", help="onnxruntime | tensorrt | cudagraph (default: the launch file's)")
    p.add_argument("--recipe", help="fp32 | int8-ort | int8-trt (default: the launch file's)")
    p.set_defaults(func=cmd_build_engines)

    p = sub.add_parser("calibrate", help="record the int8 recipes' calibration set from real frames (calib/<model>/)")
    p.add_argument("--launch", required=True, help="TOML launch file (its model, cache and reuse settings)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--drive", help="a drive (.mcap native or ROS 2, or a video file)")
    source.add_argument("--frames", help="a folder of .png/.jpg frames (name order; one per camera in turn)")
    p.add_argument("--frames-max", type=int, default=16, help="frames to run and calls kept per step (default 16)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("keys", help="create CURVE server and client keys")
    p.add_argument("--out", required=True, help="directory to create")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("convert", help="convert an mp4 to a native drive (MCAP)")
    p.add_argument("video")
    p.add_argument("--out", required=True, help="DRIVE.mcap to write")
    p.add_argument("--fps", type=float, help="resample to this rate (default: the video's)")
    p.add_argument("--size", help="resize to WIDTHxHEIGHT (default: the video's)")
    p.add_argument("--encoding", choices=["rgb8", "jpeg"], default="rgb8")
    p.add_argument("--camera", default="front")
    p.set_defaults(func=cmd_convert)


def add_drive_commands(sub) -> None:
    """replay, record, demo, report compare."""
    p = sub.add_parser("replay", help="replay a drive through the node and write a latency report")
    p.add_argument("drive", help="native drive (.mcap), ROS 2 bag (.mcap) or video file (.mp4)")
    p.add_argument("--launch", help="launch file (default launch/cpu.toml)")
    p.add_argument("--connect", action="store_true",
                   help="use the node already running at the launch file's addresses instead of starting one")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, default=1.0, help="recorded timing x RATE (default 1.0)")
    pace.add_argument("--as-fast-as-possible", action="store_true",
                      help="closed loop: send the next frame once the node answered the previous one")
    p.add_argument("--loop", type=int, default=1, help="play the drive N times (default 1)")
    p.add_argument("--record-out", help="also record the replay (frames, commands, actions, health) into this "
                                        "drive (.mcap, Foxglove schemas; must not exist) with its layout beside it")
    p.add_argument("--topic", help="replay one camera: its topic or camera name")
    p.add_argument("--out", default="out/replay", help="report directory (default out/replay)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--warmup-timeout", dest="warmup_timeout_s", type=float,
                   help="seconds to wait for the node to answer (default 300: a cold model on a busy small CPU)")
    add_set_option(p)
    add_address_options(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("record", help="record a running node's frames, commands, actions and health")
    p.add_argument("--launch", help="launch file whose addresses are recorded (default launch/cpu.toml)")
    p.add_argument("--out", required=True, help="native drive (.mcap) to write; must not exist")
    p.add_argument("--duration", type=float, help="seconds to record (default: until Ctrl-C)")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    add_address_options(p)
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("view", help="a Foxglove live view of a running node (WebSocket server on loopback)")
    p.add_argument("--launch", help="launch file whose addresses are viewed (default launch/cpu.toml)")
    p.add_argument("--port", type=int, default=8765, help="the server's port (default 8765; 0 = any free one)")
    p.add_argument("--duration", type=float, help="seconds to serve (default: until Ctrl-C)")
    p.add_argument("--layout-out", default="vla-node.layout.json",
                   help="Foxglove layout file to write (default vla-node.layout.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    add_address_options(p)
    p.set_defaults(func=cmd_view)

    p = sub.add_parser("demo", help="replay a synthetic drive through the node and write its report")
    p.add_argument("--out", default="out/demo", help="output directory (default out/demo)")
    p.add_argument("--seconds", type=float, help="length of the synthetic drive (default 20)")
    p.add_argument("--launch", help="launch file (default launch/cpu.toml)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("report", help="work with latency reports")
    report_sub = p.add_subparsers(dest="report_command", required=True)
    q = report_sub.add_parser("compare", help="compare two report.json files; exit 1 on a regression")
    q.add_argument("a", help="baseline report.json")
    q.add_argument("b", help="new report.json")
    q.add_argument("--max-regression", type=float, default=10.0, help="allowed p99 / misses growth in %%")
    q.set_defaults(func=cmd_report_compare)


def add_fleet_commands(sub) -> None:
    """fleet run | shard | merge | compare."""
    p = sub.add_parser("fleet", help="replay a library of drives across machines (Ray, or shards) into one report")
    fleet_sub = p.add_subparsers(dest="fleet_command", required=True)

    def jobs_options(q: argparse.ArgumentParser) -> None:
        q.add_argument("drives", nargs="+", help="drives, folders of drives, or .txt lists (one path per line)")
        q.add_argument("--launch", required=True, help="launch file every job's node starts from")
        q.add_argument("--out", required=True, help="fleet folder: rows/, jobs/<job>/, fleet.json, fleet.html")
        pace = q.add_mutually_exclusive_group()
        pace.add_argument("--rate", type=float, default=1.0, help="recorded timing x RATE (a timed run, default 1)")
        pace.add_argument("--as-fast-as-possible", action="store_true",
                          help="a throughput run: one frame in flight; jobs may share a machine")
        q.add_argument("--repeat", type=int, default=1, help="replay each drive K times (default 1)")
        q.add_argument("--resume", action="store_true", help="skip the jobs whose row in --out is ok")
        q.add_argument("--max-attempts", type=int, default=3, help="attempts per job before it is a failed row")
        q.add_argument("--no-progress", action="store_true", help="no progress lines")
        add_set_option(q)

    q = fleet_sub.add_parser("run", help="one Ray task per (drive, repeat); timed replays one per machine")
    jobs_options(q)
    where = q.add_mutually_exclusive_group()
    where.add_argument("--ray", dest="ray_address", help="a running Ray cluster's address (ray start --head)")
    where.add_argument("--local", type=int, help="start a local Ray of N CPUs (one replay slot) for this run")
    q.set_defaults(func=cmd_fleet_run)
    q = fleet_sub.add_parser("shard", help="the drives whose position mod COUNT is INDEX, here, one after another")
    jobs_options(q)
    q.add_argument("--index", type=int, default=None,
                   help="this shard (default $JOB_COMPLETION_INDEX, a Kubernetes Indexed Job's)")
    q.add_argument("--count", type=int, required=True, help="number of shards")
    q.set_defaults(func=cmd_fleet_shard)
    q = fleet_sub.add_parser("merge", help="join shards' folders into one fleet report")
    q.add_argument("dirs", nargs="+", help="the shards' --out folders")
    q.add_argument("--out", required=True, help="folder for the merged fleet.json and fleet.html")
    q.set_defaults(func=cmd_fleet_merge)
    q = fleet_sub.add_parser("compare", help="per-drive regressions between two fleet.json; exit 1 on any")
    q.add_argument("base", help="baseline fleet.json")
    q.add_argument("new", help="new fleet.json")
    q.add_argument("--max-regression", type=float, default=10.0, help="allowed p99 / misses growth in %% (10)")
    q.add_argument("--max-action-deviation", type=float,
                   help="allowed mean |action difference| over the frames both ran (default: reported only)")
    q.set_defaults(func=cmd_fleet_compare)


def add_fuzz_command(sub) -> None:
    """fuzz."""
    p = sub.add_parser("fuzz", help="mutation-fuzz every decoder of outside input (wire, drives, launch files, "
                                    "checkpoints); exit 1 on any failure")
    p.add_argument("--minutes", type=float, required=True, help="time for mutated inputs after the seeds")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--target", action="append", metavar="NAME",
                   help="fuzz only this target (repeatable): codec, frame, command, action, health, drive, launch, "
                        "checkpoint (default all)")
    p.add_argument("--out", default="out/fuzz", help="where failing inputs and summary.json go (default out/fuzz)")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_fuzz)


def add_bench_commands(sub) -> None:
    """bench all | model | cache | node | engines | recipes | attention | reuse."""
    p = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    add_bench_shared(p)
    bench = p.add_subparsers(dest="what", required=True)
    q = bench_parser(bench, "all", "every benchmark in one run: DIR/bench.json, bench.md, bench.html")
    q.add_argument("--out", dest="out_dir", help="report directory (default out/bench)")
    q.add_argument("--drive", help="the clip (default: the shared freeway clip where found, else a synthetic drive)")
    q.add_argument("--launch", help="launch file of the node run and the model (default launch/cpu.toml)")
    q.add_argument("--frames", type=int, help="clip frames at 10 fps for the per-frame figures (default 30)")
    q.add_argument("--threads", type=int, help="torch intra-op threads of every section but the node's (default: "
                   "the launch file's model.threads; auto: every CPU where the publisher may run at SCHED_FIFO, "
                   "else 1)")
    q.add_argument("--quick", action="store_true", default=None,
                   help="a smoke run: 8 frames, fewer rounds, without the cache/engines/reuse benchmarks")
    q = bench_parser(bench, "model", "our cached policy against the reference and transformers' generate")
    q.add_argument("--iters", type=int, help="timed rounds (default 5)")
    add_threads(q)
    q = bench_parser(bench, "cache", "the multi-rate cache's stages, INT8 vision KV, attention modes")
    q.add_argument("--iters", type=int, help="timed rounds after one warm-up round (default 5)")
    add_threads(q)
    q.add_argument("--compute-dtype", choices=["auto", "fp32", "bf16"],
                   help="compute dtype (default fp32, as launch/cpu.toml; auto: bf16 where the CPU has bf16 hardware)")
    q.add_argument("--weights", choices=["fp16", "fp32", "packed"],
                   help="linear weights (default: fp16 with fp32 compute where fbgemm exists, packed with bf16 compute "
                        "where the CPU has bf16 hardware, else plain)")
    q = bench_parser(bench, "node", "the node over real loopback ZeroMQ against its latency targets")
    q.add_argument("--seconds", type=float, help="measured run length (default 60)")
    q.add_argument("--launch", help="launch file instead of launch/cpu.toml (its own preset applies)")
    q = bench_parser(bench, "soak", "the node under camera load for minutes: RSS growth, missed ticks, counters")
    q.add_argument("--minutes", type=float, required=True, help="run length in minutes")
    q.add_argument("--camera", dest="cameras", action="append", metavar="NAME=WxH@FPS",
                   help="a camera the client publishes (repeat for more; default front=1920x1080@30 rear=640x480@30)")
    q.add_argument("--launch", help="launch file whose [[cameras]] are replaced (default launch/cpu.toml)")
    q.add_argument("--control-hz", type=float, help="control rate (default the launch file's)")
    q.add_argument("--encoding", choices=["rgb8", "jpeg"], help="frame encoding (default rgb8)")
    q.add_argument("--out", dest="out_dir", help="keep the derived launch file, its checkpoint, the node log and "
                                                 "soak.json in DIR (default: a temporary folder, nothing kept)")
    q = bench_parser(bench, "engines", "each pure step in torch and ONNX Runtime (fp32, int8), with parity")
    q.add_argument("--iters", type=int, help="timed rounds (default 10)")
    add_threads(q)
    q = bench_parser(bench, "recipes", "each engine recipe's accuracy on real frames against the torch steps in fp32")
    q.add_argument("drives", nargs="+", help="mp4 files or drives")
    q.add_argument("--max-frames", type=int, help="first frames of each drive, at its rate (default 30)")
    q.add_argument("--calibration-frames", type=int,
                   help="synthetic frames the int8-trt calibration records (default 8)")
    q = bench_parser(bench, "closed-loop", "a trained policy driven by the node under each optimisation, side by side")
    q.add_argument("--checkpoints", help="DIR/bins and DIR/flow (trained there where missing; default "
                                         "checkpoints/tiny, the trained ones kept with the code)")
    q.add_argument("--minutes", type=float, help="each drive's length (default 1)")
    q.add_argument("--seeds", type=int, nargs="+", help="roads, each driven by every configuration (default 0)")
    q.add_argument("--heads", nargs="+", choices=("bins", "flow"), help="action heads (default both)")
    q.add_argument("--only", nargs="+", metavar="NAME", help="only these configurations (e.g. reference defaults)")
    q.add_argument("--out", dest="out_dir", help="keep every drive's reports, engines and calibration here")
    q = bench_parser(bench, "attention", "segmented against gathered attention over the partitions")
    add_threads(q)
    q = bench_parser(bench, "reuse", "vision-token reuse on real clips: reuse ratio, time saved, action deviation")
    q.add_argument("drives", nargs="+", help="mp4 files or drives")
    q.add_argument("--thresholds", type=float, nargs="+", help="gate thresholds (default 0 2 4 8 16)")
    q.add_argument("--rates", type=number_or_native, nargs="+",
                   help="'native' and/or frame rates in Hz (default native 10)")
    q.add_argument("--max-frames", type=int, help="frames per clip and rate (default 12; 0 = all)")
    q.add_argument("--cache", choices=["default", "exact"],
                   help="default: text bf16, vision int8 (what the node runs); exact: all fp32")
    q.add_argument("--pixel-floor", action="store_true", default=None,
                   help="also run the reference on each gate's reference picture")
    q.add_argument("--weights", choices=["fp16", "fp32"],
                   help="linear weights of every run, the reference's too (default fp16 where fbgemm exists)")
    q.add_argument("--layer-budget", type=float,
                   help="reuse.layer_budget of every reuse run (per layer this many times the gate's tokens are "
                        "recomputed: the most drifted too; default off)")
    q.add_argument("--shared-drift-samples", type=int,
                   help="reuse.shared_drift_samples (reused tokens sampled per layer; 0 = off; default the launch "
                        "default)")
    q.add_argument("--max-age", type=int, help="reuse.max_age (changing frames a patch may be reused; 0 = off)")
    add_threads(q)


def bench_parser(bench, name: str, help_text: str) -> argparse.ArgumentParser:
    q = bench.add_parser(name, help=help_text)
    add_bench_shared(q)
    q.set_defaults(func=cmd_bench)
    return q


def add_bench_shared(q: argparse.ArgumentParser) -> None:
    """--preset and --json, taken before or after the benchmark's name (not set: the benchmark's own default)."""
    q.add_argument("--preset", default=argparse.SUPPRESS, help="model preset (default small)")
    q.add_argument("--json", dest="json_path", default=argparse.SUPPRESS, help="also write the figures to this JSON file")


def add_threads(q: argparse.ArgumentParser) -> None:
    q.add_argument("--threads", type=int, help="torch intra-op threads (default 1: no OpenMP spin on small CPUs)")


def number_or_native(text: str) -> str | float:
    try:
        return "native" if text == "native" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'native' or a rate in Hz") from None


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's (bad file, bad value): one line, exit 2, no traceback."""
    from vla_node.drives.open import DriveError
    from vla_node.model.checkpoint import CheckpointError
    from vla_node.model.tokenizer import TokenizerError
    from vla_node.node.process import NodeProcessError
    from vla_node.report.report import ReportError

    return (ConfigError, CheckpointError, DriveError, ReportError, TokenizerError, NodeProcessError, FileNotFoundError,
            FileExistsError, PermissionError, IsADirectoryError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # our own messages at INFO; libraries' at WARNING (an engine build's exporter and quantizer log thousands of
    # INFO lines, some through the root logger)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("vla_node").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except user_errors() as e:
        print(f"vla-node {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
