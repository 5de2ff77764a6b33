"""The `vla-node` command. The only place logging is configured.

User errors (bad input files, bad config values) print one line and exit 2; an unexpected exception in
the node is reported with its traceback and exits non-zero so launch restarts the node.
"""

from __future__ import annotations

import argparse
import logging
import sys

from vla_node.validate import ConfigError

log = logging.getLogger("vla_node")


def cmd_init(args) -> int:
    from vla_node.model import build_vla, preset, save_checkpoint

    model = build_vla(preset(args.preset), seed=args.seed)
    path = save_checkpoint(model, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.preset} checkpoint (seed {args.seed}, {n / 1e6:.1f} M parameters) to {path}")
    return 0


# the flags each bench takes (the others are refused, not silently ignored)
BENCH_FLAGS = {"model": ("iters", "threads"), "cache": ("iters", "threads", "compute_dtype", "weights"),
               "node": ("seconds",), "reuse": ("threads", "weights")}


def cmd_bench(args) -> int:
    for flag in ("iters", "threads", "seconds", "compute_dtype", "weights"):
        if getattr(args, flag) is not None and flag not in BENCH_FLAGS[args.what]:
            takes = ", ".join("--" + f.replace("_", "-") for f in BENCH_FLAGS[args.what])
            raise ConfigError(f"bench {args.what}: --{flag.replace('_', '-')} does not apply (it takes {takes})")
    iters = 5 if args.iters is None else args.iters
    threads = 1 if args.threads is None else args.threads
    if args.what == "model":
        from vla_node import bench_model

        bench_model.run(args.preset, iters=iters, threads=threads, json_path=args.json)
    elif args.what == "cache":
        from vla_node import bench_cache

        bench_cache.run(args.preset, iters=iters, threads=threads, json_path=args.json, weights=args.weights,
                        compute_dtype=args.compute_dtype or "fp32")
    elif args.what == "node":
        from vla_node import bench_node

        bench_node.run(args.preset, seconds=60.0 if args.seconds is None else args.seconds, json_path=args.json)
    else:
        from vla_node import bench_reuse

        if not args.drives:
            raise ConfigError("bench reuse: expected one or more DRIVE arguments (mp4 files or drives)")
        if args.weights == "packed":
            raise ConfigError("bench reuse: --weights packed does not apply (it takes fp16 or fp32)")
        bench_reuse.run(args.drives, preset=args.preset, threads=threads, json_path=args.json, weights=args.weights)
    return 0


def cmd_report_compare(args) -> int:
    from vla_node.report import compare_reports, load_report

    text, regressed = compare_reports(load_report(args.a), load_report(args.b), args.max_regression)
    print(text)
    return 1 if regressed else 0


def launch_config(args):
    """The launch file with the command line's address overrides applied (validated again)."""
    import dataclasses

    from vla_node.config import default_launch, load_launch

    config = load_launch(args.launch or default_launch())
    overrides = {k: getattr(args, k) for k in ("frames", "commands", "actions", "health") if getattr(args, k, None)}
    if overrides:
        config = config.replace(transport=dataclasses.replace(config.transport, **overrides))
    return config


def cmd_run(args) -> int:
    from vla_node.node import Node

    config = launch_config(args)
    return Node(config).run()


def cmd_keys(args) -> int:
    from vla_node.keys import create_keys

    paths = create_keys(args.out)
    print(f"wrote CURVE keys to {args.out}: {paths}")
    return 0


def cmd_convert(args) -> int:
    from vla_node.convert import convert_video

    size = parse_size(args.size) if args.size else None
    summary = convert_video(args.video, args.out, fps=args.fps, size=size, encoding=args.encoding, camera=args.camera)
    print(f"wrote {args.out}: {summary.frames} frames, {summary.duration_s:.2f} s, {summary.bytes / 1e6:.1f} MB")
    return 0


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--size {text!r}: expected WIDTHxHEIGHT, e.g. 640x480") from None
    return w, h


def add_address_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", help="address the node's frame SUB connects to (overrides the launch file)")
    p.add_argument("--commands", help="address the node's command SUB connects to")
    p.add_argument("--actions", help="address the node's action PUB binds")
    p.add_argument("--health", help="address the node's health PUB binds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vla-node", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="write a randomly initialised checkpoint directory")
    p.add_argument("--preset", default="small", help="tiny | small | base")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("run", help="run the node")
    p.add_argument("--launch", help="TOML launch file (default launch/cpu.toml)")
    add_address_options(p)
    p.set_defaults(func=cmd_run)

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

    from vla_node import demo, record, replay

    p = sub.add_parser("replay", help="replay a drive through the node and write a latency report")
    replay.add_replay_arguments(p)
    p.set_defaults(func=replay.replay_command)

    p = sub.add_parser("record", help="record a running node's frames, commands, actions and health")
    record.add_record_arguments(p)
    p.set_defaults(func=record.record_command)

    p = sub.add_parser("demo", help="replay a synthetic drive through the node and write its report")
    demo.add_demo_arguments(p)
    p.set_defaults(func=demo.demo_command)

    p = sub.add_parser("report", help="work with latency reports")
    report_sub = p.add_subparsers(dest="report_command", required=True)
    q = report_sub.add_parser("compare", help="compare two report.json files; exit 1 on a regression")
    q.add_argument("a", help="baseline report.json")
    q.add_argument("b", help="new report.json")
    q.add_argument("--max-regression", type=float, default=10.0, help="allowed p99 / misses growth in %%")
    q.set_defaults(func=cmd_report_compare)

    p = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    p.add_argument("what", choices=["model", "cache", "node", "reuse"])
    p.add_argument("drives", nargs="*", help="bench reuse: mp4 files or drives")
    p.add_argument("--preset", default="small")
    p.add_argument("--iters", type=int, default=None, help="bench model and cache: timed rounds (default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="bench model, cache and reuse: torch threads (default 1: no OpenMP spin on small CPUs)")
    p.add_argument("--seconds", type=float, default=None, help="bench node: run length (default 60)")
    p.add_argument("--compute-dtype", choices=["auto", "fp32", "bf16"], default=None,
                   help="bench cache: compute dtype (default fp32, as launch/cpu.toml; auto: bf16 where the CPU has "
                        "bf16 hardware)")
    p.add_argument("--weights", choices=["fp16", "fp32", "packed"], default=None,
                   help="bench cache and reuse: linear weights (default fp16 where fbgemm exists, as launch/cpu.toml; "
                        "bench cache with bf16 compute: packed where the CPU has bf16 hardware)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.set_defaults(func=cmd_bench)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's (bad file, bad value): one line, exit 2, no traceback."""
    from vla_node.drive import DriveError
    from vla_node.model.checkpoint import CheckpointError
    from vla_node.model.tokenizer import TokenizerError
    from vla_node.node_process import NodeProcessError
    from vla_node.report import ReportError

    return (ConfigError, CheckpointError, DriveError, ReportError, TokenizerError, NodeProcessError, FileNotFoundError,
            FileExistsError, PermissionError, IsADirectoryError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except user_errors() as e:
        print(f"vla-node {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
