"""The `pivot` command: argument parsing and dispatch to the subcommands.

Subcommand modules are imported lazily so that `pivot --help` stays instant even though
a real run imports torch and DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from pivot import __version__
from pivot.cli import interrupts
from pivot.cli.bench_planner import planner_devices
from pivot.cli.flags import OneLineParser, non_negative, positive
from pivot.cli.runconfig import DEFAULT_CONFIG
from pivot.config import ConfigError
from pivot.deployment import KIND_NAMES


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"pivot {__version__}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from pivot.cli import run

    if args.config is not None and "=" in args.config and not os.path.exists(args.config):
        # `pivot run key=value ...`: the default config (or a resumed run's), overridden
        args.overrides.insert(0, args.config)
        args.config = None

    return run.main(args)


def _cmd_bench_bus(args: argparse.Namespace) -> int:
    from pivot.bus import bench

    result = bench.run_bench(quick=args.quick, signed=args.signed)
    print(json.dumps(result, sort_keys=True) if args.json else bench.format_table(result))
    return 0


def _cmd_bench_planner(args: argparse.Namespace) -> int:
    from pivot.cli import bench_planner

    kwargs = {"sizes": tuple(args.sizes)} if args.sizes else {}
    if args.repeats is not None:
        kwargs["repeats"] = args.repeats
    result = bench_planner.run_bench(seed=args.seed, **kwargs)
    print(json.dumps(result, sort_keys=True) if args.json else bench_planner.format_table(result))
    return 0


def _cmd_bench_gps(args: argparse.Namespace) -> int:
    from pivot.cli import bench_gps

    bench_gps.main(threads=args.threads, repeat=args.repeat)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pivot",
        description="RL post-training runtime that shifts devices between rollout, "
        "generative reward and training while the job runs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=_cmd_version)

    p = sub.add_parser("run", help="run an RL job from a TOML config")
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help=f"default {DEFAULT_CONFIG} (with --resume: the run's)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="set a config key, e.g. training.lr=2e-4 (the value TOML; a bare word a string)",
    )
    p.add_argument(
        "--run-dir", default=None, help="where logs and metrics go (default runs/<time>)"
    )
    p.add_argument("--seed", type=int, default=None, help="override the config's seed")
    p.add_argument(
        "--deployment",
        choices=KIND_NAMES,
        default=None,
        help="override the config's deployment.kind",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue RUN_DIR after its last complete checkpoint, with its config",
    )
    p.set_defaults(func=_cmd_run)

    from pivot.cli import journal, newmodel, ops, report, simulate

    ops.add_parsers(sub)
    simulate.add_parser(sub)
    report.add_parser(sub)
    journal.add_parser(sub)
    newmodel.add_parser(sub)
    from pivot.cli import monitor

    monitor.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print numbers")
    bsub = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    p = bsub.add_parser("bus", help="actor layer vs raw pynng: round trip and pub/sub rate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    p.add_argument("--signed", action="store_true", help="sign every frame (tcp is always signed)")
    p.set_defaults(func=_cmd_bench_bus)
    p = bsub.add_parser("planner", help="planner decision time at 16..1024 devices")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--sizes",
        type=planner_devices,
        nargs="+",
        help="device counts, whole hosts of 4, at least two (default 16..1024)",
    )
    p.add_argument("--repeats", type=positive, default=None, help="decisions per size")
    p.add_argument("--seed", type=non_negative, default=0)
    p.set_defaults(func=_cmd_bench_planner)
    p = bsub.add_parser("gps", help="parameter store Write/Read throughput (GB/s)")
    p.add_argument("--threads", type=positive, default=None, help="torch threads")
    p.add_argument("--repeat", type=positive, default=10, help="timed repeats (default 10)")
    p.set_defaults(func=_cmd_bench_gps)
    from pivot.cli import bench_shift, bench_trainer

    bench_shift.add_parser(bsub)
    bench_trainer.add_parser(bsub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse ends a positional list at the first flag: `pivot run C --seed 1 k=v` leaves
        # k=v over; it is an override like those before the flag
        if isinstance(getattr(args, "overrides", None), list) and not any(
            a.startswith("-") for a in extra
        ):
            args.overrides.extend(extra)
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with interrupts.stop_signals():
            return args.func(args)
    except ConfigError as exc:
        print(f"pivot: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # SIGINT, SIGTERM or SIGHUP: 130, 143 or 129
        return interrupts.report(exc)


if __name__ == "__main__":
    sys.exit(main())
