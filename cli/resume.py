"""Continuing a run: which checkpoint it continues from, and the run folder made consistent
with it before anything starts.

The run continues at the step after its last complete checkpoint (``pivot.actors.
checkpoints``). ``metrics.jsonl`` then loses the step records after that checkpoint (they
are run again) and gains a ``resume`` record saying which steps were cut and where the run
continues, so a step never appears twice. The shift journal of the stopped processes is set
aside (``shift.journal.N``): it describes an allocation that ended with them.

    resume_point(run_dir) -> Checkpoint             raises ConfigError
    rewind(run_dir, checkpoint, at) -> [cut steps]
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from pivot.actors.checkpoints import Checkpoint, Checkpoints
from pivot.config import ConfigError

CHECKPOINTS = "checkpoints"


class ResumeRecord(msgspec.Struct, frozen=True, kw_only=True, tag="resume", tag_field="type"):
    """A line of metrics.jsonl: the run resumed from ``checkpoint`` at ``next_step``; the
    step records of ``cut_steps`` (written after the checkpoint) were removed."""

    checkpoint: str
    next_step: int
    policy_version: int
    cut_steps: list[int]
    at: str  # when, ISO 8601 UTC


def checkpoints_of(run_dir: Path, *, every: int = 0, keep: int = 0, last_step: int = 0):
    return Checkpoints(run_dir / CHECKPOINTS, every=every, keep=keep, last_step=last_step)


def resume_point(run_dir: Path) -> Checkpoint:
    if not run_dir.is_dir():
        raise ConfigError(str(run_dir), "--resume", "a run folder", "no such folder")
    latest = checkpoints_of(run_dir).latest()
    if latest is None:
        raise ConfigError(
            str(run_dir),
            "--resume",
            "a run with a complete checkpoint (checkpoint.every, or one that finished)",
            f"none in {run_dir / CHECKPOINTS}",
        )
    return latest


def rewind(run_dir: Path, checkpoint: Checkpoint, at: str) -> list[int]:
    """Cut metrics.jsonl back to the checkpoint (written whole, then renamed over the old
    one) and set the journal aside; returns the steps cut."""
    metrics = run_dir / "metrics.jsonl"
    kept, cut = [], []
    if metrics.is_file():
        for line in metrics.read_bytes().splitlines():
            if not line.strip():
                continue
            record = msgspec.json.decode(line)
            step = record.get("step") if record.get("type", "step") == "step" else None
            if step is not None and step >= checkpoint.state.next_step:
                cut.append(step)
            else:
                kept.append(line)
    kept.append(
        msgspec.json.encode(
            ResumeRecord(
                checkpoint=str(checkpoint.folder),
                next_step=checkpoint.state.next_step,
                policy_version=checkpoint.state.policy_version,
                cut_steps=cut,
                at=at,
            )
        )
    )
    staging = metrics.with_name(".metrics.jsonl.partial")
    staging.write_bytes(b"\n".join(kept) + b"\n")
    os.replace(staging, metrics)
    journal = run_dir / "shift.journal"
    if journal.exists():
        n = 1
        while (run_dir / f"shift.journal.{n}").exists():
            n += 1
        os.replace(journal, run_dir / f"shift.journal.{n}")
    return cut
