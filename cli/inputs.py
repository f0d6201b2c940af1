"""What a job reads of the user's before anything starts: its data files, its rollout and
reward code, its GenRM template, each checked here so that a bad one is one line (exit 2) before any child
process starts. Paths in a config are relative to the config file's folder.

    read_inputs(job, config) -> Inputs        raises ConfigError
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivot import task
from pivot.config import ConfigError
from pivot.data import Record, RecordStream, read_records
from pivot.job import JobConfig
from pivot.prompts import DEFAULT_TEMPLATE, Render, jinja_render, load_template
from pivot.rewards import RewardInput, load_function
from pivot.rollout import load_rollout, single_turn

#: Sequence ids of evaluation samples start here, far above any training step's.
EVAL_IDS = 1 << 40


@dataclass(frozen=True)
class Inputs:
    """A job's prompts and reward code, read and checked."""

    stream: Any  # RecordStream, or the task's AdditionStream: .batch(step, n) -> [Record]
    evaluation: RecordStream | None  # the eval set, in file order
    steps: int  # the job's steps, fewer than asked when the data ends first
    reward: Callable[[RewardInput], Any] | None  # reward.kind = "function"
    checker: Callable[[RewardInput], bool] | None
    verdict: Callable[[str], Any]
    judge_text: Render
    data_line: str  # what the job says about its data when it starts
    rollout: Callable = single_turn  # rollout.function (pivot.rollout)


def _path(base: Path, value: str) -> Path:
    p = Path(value)
    return p if p.is_absolute() else base / p


def read_inputs(job: JobConfig, config: str) -> Inputs:
    base = Path(config).parent
    d, r = job.data, job.reward

    def function(key: str, value: str) -> Callable:
        return load_function(value, source=config, key=key, base=base)

    if d.train:
        records = read_records(_path(base, d.train), d.prompt_key, d.reference_key)
        stream: Any = RecordStream(records, seed=job.seed, shuffle=d.shuffle, epochs=d.epochs)
        per_step = job.rollout.prompts_per_step
        available = stream.steps_available(per_step)
        if available == 0:
            raise ConfigError(
                config,
                "data.epochs",
                f"enough records for one step of {per_step} prompts",
                f"{len(records)} records x {d.epochs} epochs",
            )
        steps = min(job.steps, available) if available is not None else job.steps
        data_line = f"data {d.train}: {len(records)} prompts, " + (
            f"{d.epochs} epochs = {available} steps of {per_step}; running {steps}"
            if available is not None
            else "reshuffled every epoch"
        )
        checker = function("reward.checker", r.checker) if r.checker else None
        default_render = jinja_render(DEFAULT_TEMPLATE, source="pivot.prompts", key="")
    else:
        stream, steps = task.AdditionStream(job.seed), job.steps
        data_line = "data: the arithmetic task, made from the seed"
        checker = function("reward.checker", r.checker) if r.checker else task.check
        default_render = task.judge_text
    evaluation = None
    if d.eval:
        eval_records = read_records(_path(base, d.eval), d.prompt_key, d.reference_key)
        evaluation = RecordStream(eval_records, seed=job.seed, shuffle=False)
        data_line += f"; eval {d.eval}: {len(eval_records)} prompts"
    judge_text = (
        load_template(_path(base, r.template), source=config, key="reward.template")
        if r.template
        else default_render
    )
    if r.kind == "genrm":
        _probe(judge_text, stream, r.template or "the default template", config)
    return Inputs(
        stream=stream,
        evaluation=evaluation,
        steps=steps,
        reward=function("reward.function", r.function) if r.kind == "function" else None,
        checker=checker,
        verdict=function("reward.verdict", r.verdict) if r.verdict else task.verdict,
        judge_text=judge_text,
        data_line=data_line,
        rollout=load_rollout(job.rollout.function, source=config, base=base)
        if job.rollout.function
        else single_turn,
    )


def _probe(render: Render, stream: Any, name: str, config: str) -> None:
    """Render the template once on the first record, so that a variable it names but the data
    lacks is an error now, not a failed reward for every sample."""
    record: Record = stream.batch(0, 1)[0]
    try:
        render(record, "a response")
    except Exception as exc:
        raise ConfigError(
            config, "reward.template", f"{name} to render a record", f"{type(exc).__name__}: {exc}"
        ) from None
