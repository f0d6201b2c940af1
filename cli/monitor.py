"""`pivot monitor [RUN_DIR]`: a run on one screen, live while its job runs, replayed after.

RUN_DIR defaults to the newest run under ``runs/``. A job that runs (``RUN/job.json`` says
so and its process is alive) is watched over its bus: the Monitor's event stream, caught up
from the run's ``events.jsonl`` and the Monitor's snapshot; otherwise ``events.jsonl`` is
replayed. Textual is imported only when the command runs (``pivot --help`` stays instant).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pivot.events import EVENTS_FILE

RUNS = Path("runs")


class BadRun(Exception):
    """A RUN_DIR the monitor cannot show; ``str()`` is the one line to print."""


def newest_run(root: Path = RUNS) -> Path:
    runs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    if not runs:
        raise BadRun(f"no run under {root}/; name a RUN_DIR")
    return max(runs, key=lambda p: (p.stat().st_mtime, p.name))


def running_job(run_dir: Path) -> dict | None:
    """The job file of a job that runs now, else None (none, ended, or its process died)."""
    from pivot.cli.jobfile import RUNNING, job_state, read_job

    info = read_job(run_dir)
    return info if info is not None and job_state(info) == RUNNING else None


def open_source(run_dir: Path):  # noqa: ANN201 - an EventSource
    """The live stream of ``run_dir``'s job when it runs and publishes one, else its replay."""
    from pivot.cli.event_sources import LiveSource, NoEventStream, ReplaySource

    if not run_dir.is_dir():
        raise BadRun(f"{run_dir}: no such run folder")
    info = running_job(run_dir)
    path = run_dir / EVENTS_FILE
    if info is not None:
        try:
            return LiveSource.of_job(info, record=path, ended=lambda: running_job(run_dir) is None)
        except NoEventStream:
            pass  # an older job: what its events.jsonl holds so far
    if not path.is_file():
        raise BadRun(f"{run_dir}: no {EVENTS_FILE} and no running job to attach to")
    return ReplaySource(path)


def main(args: argparse.Namespace) -> int:
    try:
        run_dir = Path(args.run_dir) if args.run_dir else newest_run()
        source = open_source(run_dir)
    except BadRun as exc:
        print(f"pivot monitor: {exc}", file=sys.stderr)
        return 2
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        # the screen needs both: without, Textual's driver hangs (measured: stdin from
        # /dev/null, or stdout to a file, never returned)
        print(
            f"pivot monitor: {run_dir}: needs a terminal (stdin and stdout); "
            f"pivot report {run_dir} writes it as an HTML file",
            file=sys.stderr,
        )
        return 2
    from pivot.cli.monitor_app import MonitorApp

    MonitorApp(source, run_name=run_dir.name).run()
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``monitor`` on the ``pivot`` command's subparsers."""
    p = subparsers.add_parser(
        "monitor",
        help="watch a run: live while its job runs, replayed after",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "run_dir", nargs="?", default=None, metavar="RUN_DIR", help=f"default: newest in {RUNS}/"
    )
    p.set_defaults(func=main)
    return p
