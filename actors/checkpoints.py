"""A run's checkpoints: where each is written, when one is complete, which is the last, and
which old ones go.

    RUN_DIR/checkpoints/step-000003/policy/       the policy after step 3: a Hugging Face folder
                                   trainer/      DeepSpeed's checkpoint: optimizer, scheduler
                                   state.json    step, policy version, data cursor; written last

The trainer writes a checkpoint into a staging folder (``.partial-step-000003``); the Driver's
side then writes ``state.json`` into it and renames the folder: a rename is atomic, so a crash
at any point leaves every ``step-*`` folder complete, and a staging folder that is never
renamed is ignored (and cleared the next time that step is staged). ``keep`` bounds how many
complete ones stay.

A trainer group that dies mid-run is restarted from the newest state it can load
(``trainer_start``): the last complete checkpoint when it holds the policy version GPS
published last (exact: weights, optimizer, scheduler and rng), else the GPS copy of that
version (the weights exact, the optimizer's moments and the rng fresh).

What resuming needs besides the trainer's state is in ``state.json``: the next step (the data
streams and the task take prompts by step, and sampling is seeded by sequence id and
position, so the step is the data cursor and every sampling RNG) and the policy version.
Batches in flight are not saved: with ``staleness`` 0 none is in flight at a checkpoint;
with more, the batches after the checkpoint are regenerated and sample the resumed policy.
The planner starts afresh (its estimates are re-learned in a few ticks).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

import msgspec

STATE = "state.json"
_PREFIX = "step-"
_STAGING = ".partial-"


class CheckpointState(msgspec.Struct, frozen=True, kw_only=True):
    """``state.json``: the step the checkpoint follows and what the run continues with."""

    step: int  # the last step trained into it
    policy_version: int
    next_step: int  # the data cursor: the step a resumed run starts at


class Checkpoint(msgspec.Struct, frozen=True):
    folder: Path
    state: CheckpointState

    @property
    def policy(self) -> Path:
        return self.folder / "policy"

    @property
    def trainer(self) -> Path:
        return self.folder / "trainer"


def read_checkpoint(folder: Path) -> Checkpoint:
    """The complete checkpoint in ``folder`` (its ``state.json``)."""
    folder = Path(folder)
    return Checkpoint(
        folder, msgspec.json.decode((folder / STATE).read_bytes(), type=CheckpointState)
    )


class TrainerStart(msgspec.Struct, frozen=True, kw_only=True):
    """What a trainer group starts from. ``source``: ``start``, the job's own starting point
    (the model, or the checkpoint ``--resume`` named); ``checkpoint``, the last complete one
    (``checkpoint`` names it); ``gps``, the GPS copy of ``version``'s weights, with a fresh
    optimizer. ``policy``: the Hugging Face folder the model is built from (under ``gps``
    only its architecture and tokenizer count). ``trainer``: the DeepSpeed state to load
    (optimizer, scheduler, each rank's rng), None for a fresh one."""

    source: Literal["start", "checkpoint", "gps"]
    version: int
    policy: str
    trainer: str | None = None
    checkpoint: str | None = None

    @property
    def exact(self) -> bool:
        """Whether training goes on as if nothing had stopped it (not under ``gps``)."""
        return self.source != "gps"


def trainer_start(
    start: TrainerStart, published: int | None, latest: Checkpoint | None
) -> TrainerStart:
    """Where a trainer group (re)starts. ``published``: the version in the job's GPS store
    (None: nothing yet, the group's first start); ``latest``: the last complete checkpoint.
    A group that finds a version published restarts after one that died: from the checkpoint
    when it holds that version, from ``start`` when that is the version, else from GPS."""
    if published is None:
        return start
    if latest is not None and latest.state.policy_version == published:
        return TrainerStart(
            source="checkpoint",
            version=published,
            policy=str(latest.policy),
            trainer=str(latest.trainer),
            checkpoint=str(latest.folder),
        )
    if start.version == published:
        return start
    if published < start.version:
        raise ValueError(
            f"GPS publishes version {published}, older than the start's {start.version}: "
            "the store is another run's"
        )
    return TrainerStart(source="gps", version=published, policy=start.policy)


class Checkpoints:
    """The checkpoints folder of a run. ``every``: a checkpoint after every ``every``-th step
    (0: none but the last); the last step always gets one. ``keep``: complete ones kept, the
    newest (0: all). Reading what a run left needs none of them: ``Checkpoints(root)``."""

    def __init__(
        self, root: Path, *, every: int = 0, keep: int = 0, last_step: int | None = None
    ) -> None:
        self.root = Path(root)
        self.every = every
        self.keep = keep
        self.last_step = last_step

    def due(self, step: int) -> bool:
        return step == self.last_step or (self.every > 0 and (step + 1) % self.every == 0)

    def _name(self, step: int) -> str:
        return f"{_PREFIX}{step:06d}"

    def folder(self, step: int) -> Path:
        """Where step ``step``'s checkpoint is once complete."""
        return self.root / self._name(step)

    def stage(self, step: int) -> Path:
        """An empty staging folder for step ``step``'s checkpoint."""
        staging = self.root / f"{_STAGING}{self._name(step)}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging

    def commit(self, state: CheckpointState) -> Checkpoint:
        """Complete the staged checkpoint of ``state.step``: its state, then the rename."""
        staging = self.root / f"{_STAGING}{self._name(state.step)}"
        path = staging / STATE
        with path.open("wb") as f:
            f.write(msgspec.json.encode(state))
            f.flush()
            os.fsync(f.fileno())
        final = self.folder(state.step)
        if final.exists():  # a run resumed from before this step wrote it once already
            shutil.rmtree(final)
        os.replace(staging, final)
        self._prune()
        return Checkpoint(final, state)

    def complete(self) -> list[Checkpoint]:
        """Every complete checkpoint, oldest first."""
        found = []
        for folder in sorted(self.root.glob(f"{_PREFIX}*")) if self.root.is_dir() else ():
            path = folder / STATE
            if not path.is_file():
                continue
            try:
                state = msgspec.json.decode(path.read_bytes(), type=CheckpointState)
            except msgspec.DecodeError:  # torn or foreign: not a checkpoint of ours
                continue
            found.append(Checkpoint(folder, state))
        return found

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old.folder, ignore_errors=True)
