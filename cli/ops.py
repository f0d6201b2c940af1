"""The operator's verbs on this host's jobs: ``pivot ps`` (the jobs under ``runs/``, from
their ``job.json``), ``pivot stop RUN`` (a request to the job's Driver: it finishes the step
it is in, checkpoints it and stops; ``--now`` abandons the step) and ``pivot logs RUN``
(``RUN/actors.log``, structlog JSON lines, rendered readably; ``-f`` follows the job).

RUN is a run dir, or a run's name under ``runs/``. ps and logs read files only: they need
neither torch nor the job's bus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from pivot.cli.jobfile import JOB_FILE, RUNNING, STARTING, job_state, read_job

RUNS = Path("runs")
LOG_FILE = "actors.log"
#: how long ``stop`` waits for the Driver to accept, and ``-f``/``stop`` poll the job file
STOP_TIMEOUT_S = 30.0
POLL_S = 0.2
#: the structlog fields every line has, rendered in their own columns
_FIXED = ("timestamp", "level", "actor", "event")


class BadRun(Exception):
    """RUN names no run: one line, exit 2."""


def find_run(run: str) -> Path:
    """``run`` as a run dir: a folder with a job file or a run config, or a name under runs/."""
    for candidate in (Path(run), RUNS / run):
        if candidate.is_dir() and (
            (candidate / JOB_FILE).is_file() or (candidate / LOG_FILE).is_file()
        ):
            return candidate
    raise BadRun(f"no run {run!r}: neither a run dir nor a run under {RUNS}/")


# -- ps


def _run_dirs(roots: Iterable[Path]) -> Iterator[Path]:
    for root in roots:
        if root.is_dir():
            yield from sorted(p for p in root.iterdir() if (p / JOB_FILE).is_file())


def job_rows(roots: Iterable[Path], everything: bool = False) -> list[dict[str, Any]]:
    """One row per job under ``roots``: the running ones (``everything``: all)."""
    rows = []
    for run_dir in _run_dirs(roots):
        info = read_job(run_dir)
        if info is None:
            continue
        state = job_state(info)
        if not everything and state not in (STARTING, RUNNING):
            continue
        steps = info.get("steps")
        rows.append(
            {
                "run": str(run_dir),
                "pid": str(info.get("pid", "")),
                "step": f"{info.get('step', 0)}/{steps}" if steps else "-",
                "deployment": str(info.get("deployment", "-")),
                "state": state,
                "started": str(info.get("started", "-")),
            }
        )
    return rows


def table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns).rstrip() for r in rows]
    return "\n".join(lines)


def cmd_ps(args: argparse.Namespace) -> int:
    roots = [Path(r) for r in args.root] if args.root else [RUNS]
    for root in roots if args.root else ():  # (runs/ is not there until a job ran here)
        if not root.is_dir():
            raise BadRun(f"--root {root}: no such folder")
    rows = job_rows(roots, everything=args.all)
    print(table(rows, ("run", "pid", "step", "deployment", "state", "started")))
    return 0


# -- stop


async def _ask_to_stop(run_dir: Path, now: bool) -> Any:
    from pivot.actors.assembly import DRIVER
    from pivot.actors.messages import StopAccepted, StopJob
    from pivot.cli.jobs import Attached

    async with Attached(run_dir, name=f"stop-{int(time.time() * 1000) % 10**9}") as job:
        return await job.actor.request(
            DRIVER, StopJob(now=now), expect=StopAccepted, timeout=STOP_TIMEOUT_S
        )


def cmd_stop(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run)
    info = read_job(run_dir)
    state = job_state(info) if info is not None else "not started"
    if state != RUNNING:
        raise BadRun(f"{run_dir}: the job is not running (state {state})")
    accepted = asyncio.run(_ask_to_stop(run_dir, args.now))
    if accepted.step < 0:
        print(f"{run_dir}: stopping now; the step in progress is abandoned")
    else:
        checkpoint = f"; checkpoint {accepted.checkpoint}" if accepted.checkpoint else ""
        print(f"{run_dir}: stopping after step {accepted.step}{checkpoint}", flush=True)
    if args.no_wait:
        return 0
    while (info := read_job(run_dir)) is not None and job_state(info) == RUNNING:
        time.sleep(POLL_S)
    print(f"{run_dir}: {job_state(info) if info else 'gone'}")
    return 0


# -- logs


def render(line: str, actor: str | None = None) -> str | None:
    """One line of actors.log, readable: time, level, actor, event, key=value (None: not
    ``actor``'s). A line that is not structlog's (a library's own text) stays as it is, and
    belongs to no actor."""
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "event" not in record:
        return None if actor is not None else line.rstrip("\n")
    who = str(record.get("actor", ""))
    if actor is not None and who != actor:
        return None
    stamp = str(record.get("timestamp", ""))
    clock = stamp[11:23] if len(stamp) >= 23 else stamp  # HH:MM:SS.mmm of the ISO time
    rest = " ".join(
        f"{k}={v if isinstance(v, str) and ' ' not in v else json.dumps(v)}"
        for k, v in record.items()
        if k not in _FIXED
    )
    level = str(record.get("level", "")).upper()
    return f"{clock} {level:7} {who or '-':18} {record['event']}" + (f"  {rest}" if rest else "")


def _follow(log: TextIO, run_dir: Path) -> Iterator[str]:
    """The log's lines, then the ones written to it, until the job no longer runs."""
    pending = ""
    while True:
        chunk = log.readline()
        if chunk:
            pending += chunk
            if pending.endswith("\n"):
                yield pending
                pending = ""
            continue
        info = read_job(run_dir)
        if info is None or job_state(info) not in (STARTING, RUNNING):
            rest = pending + log.read()
            yield from rest.splitlines(keepends=True)
            return
        time.sleep(POLL_S)


def cmd_logs(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run)
    path = run_dir / LOG_FILE
    if not path.is_file():
        raise BadRun(f"{run_dir}: no {LOG_FILE}")
    printed = 0
    with path.open(errors="replace") as log:
        lines = _follow(log, run_dir) if args.follow else log
        try:
            for line in lines:
                text = render(line, args.actor)
                if text is not None:
                    print(text, flush=args.follow)
                    printed += 1
        except BrokenPipeError:  # `pivot logs RUN | head`
            sys.stderr.close()
    if args.actor is not None and not printed and not args.follow:
        # (followed, an actor may yet start: a restarted one, a helper)
        raise BadRun(f"{path}: no line of actor {args.actor!r}; its actors: {_actors(path)}")
    return 0


def _actors(path: Path) -> str:
    """The actors with a line in the log at ``path``, sorted and joined."""
    names = set()
    with path.open(errors="replace") as log:
        for line in log:
            with contextlib.suppress(ValueError, AttributeError):
                names.add(str(json.loads(line).get("actor", "")))
    return ", ".join(sorted(names - {""})) or "none"


def _bad_run(func):  # noqa: ANN001, ANN202
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except BadRun as exc:
            print(f"pivot: {exc}", file=sys.stderr)
            return 2

    return run


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ps", help="this host's jobs (under runs/): step, deployment, state")
    p.add_argument("--all", action="store_true", help="finished jobs too (default: running)")
    p.add_argument("--root", action="append", metavar="DIR", help="look under DIR (default runs/)")
    p.set_defaults(func=_bad_run(cmd_ps))
    p = sub.add_parser("stop", help="stop a job after the step it is in, checkpointed")
    p.add_argument("run", metavar="RUN", help="a run dir, or a run's name under runs/")
    p.add_argument("--now", action="store_true", help="abandon the step in progress")
    p.add_argument("--no-wait", action="store_true", help="return once the job accepted")
    p.set_defaults(func=_bad_run(cmd_stop))
    p = sub.add_parser("logs", help="a job's actor logs, readable")
    p.add_argument("run", metavar="RUN", help="a run dir, or a run's name under runs/")
    p.add_argument("--actor", default=None, metavar="NAME", help="only this actor's lines")
    p.add_argument(
        "-f", "--follow", action="store_true", help="follow until the job no longer runs"
    )
    p.set_defaults(func=_bad_run(cmd_logs))
