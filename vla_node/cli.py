"""The `vla-node` command. The only place logging is configured.

User errors (bad input files, bad config values) print one line and exit 2; an unexpected exception in
the node is reported with its traceback and exits non-zero so launch restarts the node.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("vla_node")


def cmd_init(args) -> int:
    from vla_node.model import build_vla, preset, save_checkpoint

    model = build_vla(preset(args.preset), seed=args.seed)
    path = save_checkpoint(model, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.preset} checkpoint (seed {args.seed}, {n / 1e6:.1f} M parameters) to {path}")
    return 0


def cmd_bench(args) -> int:
    if args.what == "model":
        from vla_node import bench_model

        bench_model.run(args.preset, iters=args.iters, json_path=args.json)
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vla-node", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="write a randomly initialised checkpoint directory")
    p.add_argument("--preset", default="small", help="tiny | small | base")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    p.add_argument("what", choices=["model"])
    p.add_argument("--preset", default="small")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.set_defaults(func=cmd_bench)
    return parser


USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as e:
        print(f"vla-node {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
