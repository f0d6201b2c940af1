"""Continuing a run: which checkpoint it continues from, and the run folder made consistent
with it before anything starts.

The run continues at the step after its last complete checkpoint (``pivot.actors.
checkpoints``). ``metrics.jsonl`` then loses the step records after that checkpoint (they
are run again) and gains a ``resume`` record saying which steps were cut and where the run
continues, so a step never appears twice. The shift journal of the stopped processes is set
aside (``shift.journal.N``): it describes an allocation that ended with them.

    resume_point(run_dir) -> Checkpoint                           raises ConfigError
    check_resumed_config(run_dir, config, overrides) -> the config to run   raises ConfigError
    rewind(run_dir, checkpoint, at, overrides) -> [cut steps]
    timeline_end(path) -> the last time in timeline.jsonl (where a resumed timeline goes on)

A resumed run runs with its own ``config.toml`` and the overrides given now (recorded in
config.toml's header and in the resume record). A config file named beside ``--resume`` must
say what the run's says, but for the keys the overrides set: a run is not silently continued
under another config.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from pivot.actors.checkpoints import Checkpoint, Checkpoints
from pivot.cli.runconfig import CONFIG_NAME, read_header, resolved_config
from pivot.config import ConfigError, load_toml
from pivot.job import JobConfig

CHECKPOINTS = "checkpoints"


class ResumeRecord(msgspec.Struct, frozen=True, kw_only=True, tag="resume", tag_field="type"):
    """A line of metrics.jsonl: the run resumed from ``checkpoint`` at ``next_step``; the
    step records of ``cut_steps`` (written after the checkpoint) were removed."""

    checkpoint: str
    next_step: int
    policy_version: int
    cut_steps: list[int]
    at: str  # when, ISO 8601 UTC
    overrides: list[str] = []  # given to this resume


def checkpoints_of(run_dir: Path, **policy: int) -> Checkpoints:
    """A run's checkpoints folder (``policy``: ``Checkpoints``'s every, keep, last_step)."""
    return Checkpoints(run_dir / CHECKPOINTS, **policy)


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


def check_resumed_config(run_dir: Path, config: str | None, overrides: Sequence[str]) -> str:
    """The config a resumed run runs with: its own; ``config``, when given, must resolve
    (with the run's recorded overrides) to the same job but for the keys ``overrides`` set."""
    ran = run_dir / CONFIG_NAME
    if not ran.is_file():
        raise ConfigError(str(run_dir), "--resume", f"a run with its {CONFIG_NAME}", "none")
    if config is None:
        return str(ran)
    # the file named now, with the overrides the run started with and those given now
    earlier = read_header(ran).overrides
    given = load_toml(config, JobConfig, [*earlier, *overrides])
    given = msgspec.to_builtins(resolved_config(given, config))
    theirs = msgspec.to_builtins(load_toml(ran, JobConfig, overrides))
    changed = _differences(given, theirs)
    if changed:
        key = changed[0]
        raise ConfigError(
            config,
            key,
            f"the run's value in {ran} (to change it, pass {key}=VALUE as an override)",
            f"another value{f' (and {len(changed) - 1} more keys)' if len(changed) > 1 else ''}",
        )
    return str(ran)


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def rewind(
    run_dir: Path, checkpoint: Checkpoint, at: str, overrides: Sequence[str] = ()
) -> list[int]:
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
                overrides=list(overrides),
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


def timeline_end(path: Path) -> float:
    """The latest ``t`` in a timeline.jsonl (0 without one): a resumed run's Monitor starts
    its clock at 0 again, so its records are shifted past the stopped run's."""
    end = 0.0
    if path.is_file():
        for line in path.read_bytes().splitlines():
            try:
                t = msgspec.json.decode(line).get("t")
            except msgspec.DecodeError:
                continue  # a line torn by the stop
            if isinstance(t, int | float):
                end = max(end, float(t))
    return end
