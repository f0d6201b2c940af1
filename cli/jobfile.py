"""``RUN/job.json``: how tools find and reach a job, and what state it is in.

`pivot run` writes it as it starts the job's processes and rewrites it whole (atomically: a
reader never sees half a file) when its actors run, on each step and on every way out:
``starting``, ``running``, then ``finished``, ``stopped`` (``pivot stop``), ``failed`` or
``interrupted`` (a signal). The states are the job's phases too (``pivot.events.JobPhase``).
A job killed with SIGKILL cannot write its end: ``job_state`` reads one still ``starting`` or
``running`` whose process is gone (its pid and start time, ``owner``, as
``pivot.bus.sockets`` records them) as ``dead``.

Fields (docs/metrics.md): pid, owner, state, sockets (the bus's ipc folder), names (its
actors), step (steps done), steps, deployment, config, started, updated.

Stdlib and ``pivot.bus.sockets`` only: ``pivot ps`` reads it without torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pivot.bus.sockets import owner_alive, owner_text

JOB_FILE = "job.json"
STARTING = "starting"
RUNNING = "running"
DEAD = "dead"  # read, never written: the job's process is gone without saying so


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class JobFile:
    """The job file of the job in this process: ``update`` rewrites it with some fields
    changed (cheap: a small JSON file, renamed into place)."""

    def __init__(self, run_dir: Path, **fields: Any) -> None:
        self.path = Path(run_dir) / JOB_FILE
        self.info: dict[str, Any] = {
            "pid": os.getpid(),
            "owner": owner_text(),
            "started": utc_now(),
            **fields,
        }

    def update(self, **changes: Any) -> None:
        self.info.update(changes, updated=utc_now())
        partial = self.path.with_name(f".{JOB_FILE}.partial")
        partial.write_text(json.dumps(self.info, indent=1) + "\n")
        partial.replace(self.path)


def read_job(run_dir: Path) -> dict[str, Any] | None:
    """The job file of ``run_dir`` (None: none, or not one pivot wrote)."""
    try:
        info = json.loads((Path(run_dir) / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def job_state(info: dict[str, Any]) -> str:
    """The job's state: as written, but ``dead`` for a starting or running one whose process
    is gone."""
    state = str(info.get("state", "?"))
    if state in (STARTING, RUNNING):
        owner = info.get("owner") or str(info.get("pid", ""))
        if not owner_alive(owner):
            return DEAD
    return state
