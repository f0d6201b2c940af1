"""Where a trainer group restarts from: the last complete checkpoint when it holds the version
GPS published last (exact), else the GPS copy of that version (weights only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot.actors.checkpoints import (
    Checkpoints,
    CheckpointState,
    TrainerStart,
    read_checkpoint,
    trainer_start,
)

START = TrainerStart(source="start", version=0, policy="/models/tiny-policy")


def committed(root: Path, *versions: int) -> Checkpoints:
    """A run's checkpoints folder with one complete checkpoint per version (step v - 1)."""
    checkpoints = Checkpoints(root)
    for v in versions:
        checkpoints.stage(v - 1)
        checkpoints.commit(CheckpointState(step=v - 1, policy_version=v, next_step=v))
    checkpoints.stage(versions[-1])  # the next step's, torn: never a restart point
    return checkpoints


def test_a_first_start_is_the_jobs_own_start(tmp_path):
    latest = committed(tmp_path, 1, 2).latest()
    assert trainer_start(START, None, latest) == START
    assert trainer_start(START, None, None) == START


def test_a_checkpoint_at_the_published_version_is_the_exact_restart(tmp_path):
    latest = committed(tmp_path, 1, 2, 3).latest()
    chosen = trainer_start(START, 3, latest)
    assert chosen.source == "checkpoint" and chosen.exact and chosen.version == 3
    assert chosen.checkpoint == str(tmp_path / "step-000002")
    assert chosen.policy == str(tmp_path / "step-000002" / "policy")
    assert chosen.trainer == str(tmp_path / "step-000002" / "trainer")


def test_an_older_checkpoint_gives_way_to_the_gps_copy_with_a_fresh_optimizer(tmp_path):
    latest = committed(tmp_path, 2).latest()  # checkpoint.every = 2: v2 on disk, v3 published
    chosen = trainer_start(START, 3, latest)
    assert chosen.source == "gps" and not chosen.exact and chosen.version == 3
    assert chosen.trainer is None and chosen.checkpoint is None
    assert chosen.policy == START.policy  # the architecture and tokenizer only
    assert trainer_start(START, 3, None).source == "gps"


def test_the_start_itself_when_nothing_was_trained_since(tmp_path):
    # a group that dies in step 0: GPS holds the model it started from
    assert trainer_start(START, 0, None) == START
    # a resumed run that dies before its first step: the checkpoint it resumed from
    resumed = committed(tmp_path, 4).latest()
    start = TrainerStart(
        source="start",
        version=4,
        policy=str(resumed.policy),
        trainer=str(resumed.trainer),
        checkpoint=str(resumed.folder),
    )
    assert trainer_start(start, 4, resumed).trainer == str(resumed.trainer)
    assert trainer_start(start, 4, resumed).exact
    assert read_checkpoint(resumed.folder) == resumed


def test_a_store_older_than_the_start_is_refused():
    start = TrainerStart(source="start", version=4, policy="/runs/a/step-000003/policy")
    with pytest.raises(ValueError, match="older than the start's 4"):
        trainer_start(start, 2, None)
