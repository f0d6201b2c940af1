"""pivot as a library: a job run from your own Python process, or one you attach to.

    async with pivot.Run("configs/tiny.toml", rollout=my_rollout, steps_by_hand=True) as run:
        report = await run.step()                     # one step (or: await run.wait())
        g = await run.generate(prompt_ids, max_new_tokens=16)
        await run.submit([[trajectory_a, trajectory_b]])   # a scored group, for the next step

    async with pivot.attach("runs/20261201-1200") as job:   # a `pivot run` in another process
        g = await job.generate(prompt_ids)
        await job.submit(groups)

``Run`` is ``pivot run`` without its terminal: the config (a file, with ``key=value``
overrides) is read and checked the same way (a bad one raises ``ConfigError`` before anything
starts), the job's actors (driver, schedulers, monitor) run on your event loop and its agents,
Controller and trainer in their own processes, as ``pivot run`` starts them; its run folder
is the same. ``rollout`` is a rollout function object (``pivot.rollout``), instead of the
config's ``rollout.function``. With ``steps_by_hand`` each step waits for ``step()``;
without, the Driver runs them all and ``wait()`` returns their reports.

``attach`` reaches a running job through the address its run folder records
(``RUN/job.json``: its bus's ipc folder), signing with the job's secret when it has one
(``PIVOT_SECRET_FILE``). Its calls are requests to the job's Driver: ``generate`` goes
through the rollout scheduler like a rollout function's (a shift only delays it), ``submit``
hands scored trajectory groups to training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pivot.actors.assembly import DRIVER
from pivot.actors.driver import StepReport
from pivot.actors.messages import Ack, GenerateReply, GenerateRequest, SubmitTrajectories
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Actor, Bus, Directory, Endpoint, job_secret
from pivot.cli.jobfile import JOB_FILE, RUNNING, job_state, read_job
from pivot.config import ConfigError
from pivot.engines.protocol import SamplingParams
from pivot.rollout import sampling_with
from pivot.trajectory import Generation, Trajectory

#: how long a generate request may wait: a sequence may wait behind a whole step's
GENERATE_TIMEOUT_S = 3600.0


class _Caller:
    """generate / submit as requests to a Driver, by any actor of the job's bus."""

    actor: Actor
    sampling: SamplingParams

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        session: str = "",
    ) -> Generation:
        """One sequence through the job's rollout scheduler; unset parameters are ``Run``'s
        job's rollout sampling, ``SamplingParams``' defaults for an attached job (whose
        config this process does not read)."""
        sampling = sampling_with(
            self.sampling,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
            seed=seed,
        )
        request = GenerateRequest(prompt_ids=list(prompt_ids), sampling=sampling, session=session)
        reply = await self.actor.request(
            DRIVER, request, expect=GenerateReply, timeout=GENERATE_TIMEOUT_S
        )
        return reply.generation

    async def submit(self, groups: Sequence[Sequence[Trajectory]]) -> int:
        """Scored trajectory groups for training: they join the step rolling out now (or the
        next). Returns how many were taken; a trajectory without a reward is refused."""
        reply = await self.actor.request(
            DRIVER, SubmitTrajectories(groups=[list(g) for g in groups]), expect=Ack
        )
        return reply.count


class Run(_Caller):
    """A pivot job run from this process (see the module docstring)."""

    def __init__(
        self,
        config: str | Path | None = None,
        *,
        overrides: Sequence[str] = (),
        rollout: Callable | None = None,
        run_dir: str | Path | None = None,
        steps_by_hand: bool = False,
    ) -> None:
        self.config = str(config) if config is not None else None
        self.overrides = list(overrides)
        self.rollout = rollout
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.steps_by_hand = steps_by_hand
        self._runner: Any = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Run:
        from rich.console import Console

        from pivot.cli.run import DEFAULT_CONFIG, Job, _default_run_dir, prepare
        from pivot.cli.runconfig import refuse_existing_run, write_run_config

        config = self.config or DEFAULT_CONFIG
        job, policy, genrm, inputs = prepare(config, overrides=self.overrides)
        if self.rollout is not None:
            inputs = dataclasses.replace(inputs, rollout=self.rollout)
        run_dir = self.run_dir or _default_run_dir()
        refuse_existing_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_config(run_dir, job, config, self.overrides)
        self.run_dir = run_dir
        r = job.rollout
        self.sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p
        )
        console = Console(quiet=True, soft_wrap=True)
        self._runner = Job(
            job,
            policy,
            genrm,
            inputs,
            run_dir,
            console,
            steps_by_hand=self.steps_by_hand,
            config=config,
        )
        self._task = asyncio.ensure_future(self._runner.run())
        started = asyncio.ensure_future(self._runner.started.wait())
        await asyncio.wait([self._task, started], return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            started.cancel()
            self._task.result()  # raises why it did not start
        self.actor = self._runner.assembly.driver
        return self

    @property
    def reports(self) -> list[StepReport]:
        return self._runner.assembly.driver.reports

    async def step(self) -> StepReport:
        """Run the next step (``steps_by_hand``) and return its report."""
        driver = self._runner.assembly.driver
        done = len(driver.reports)
        driver.allow_step()
        while len(driver.reports) == done:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the job ended before the step did")
            await asyncio.sleep(0.05)
        return driver.reports[done]

    async def wait(self) -> list[StepReport]:
        """Every step's report, once the Driver has run them all."""
        reports, _ = await self._task
        return reports

    async def __aexit__(self, *exc: object) -> None:
        if self._task is None:
            return
        if not self._task.done():
            self._runner.stop()
        try:
            await self._task
        except Exception:
            if exc[0] is None:
                raise


class Attached(_Caller):
    """A running job reached through its run folder or a tcp address (see ``attach``)."""

    def __init__(self, where: str | Path, *, name: str | None = None) -> None:
        if str(where).startswith(("tcp://", "tcp4://", "tcp6://")):
            self.run_dir = None
            self.info = {}
            directory = Directory({DRIVER: Endpoint(rep=str(where), pub=str(where))})
        else:
            self.run_dir = Path(where)
            self.info = running_job(self.run_dir)
            directory = Directory.ipc(self.info["sockets"], self.info["names"])
        self.bus = Bus.nng(directory, rl_messages(), secret=job_secret())
        self.actor = Actor(name or f"attached-{os.getpid()}", self.bus)
        self.sampling = SamplingParams()

    async def __aenter__(self) -> Attached:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.close()


def running_job(run_dir: Path) -> dict:
    """A running job's ``job.json`` (``ConfigError`` when none runs there)."""
    path = run_dir / JOB_FILE
    info = read_job(run_dir)
    if info is None:
        raise ConfigError(str(path), "", "a running job's file", "none readable")
    state = job_state(info)
    if state != RUNNING:
        raise ConfigError(str(path), "state", "a running job", repr(state))
    return info


def attach(where: str | Path) -> Attached:
    """The running job of run folder ``where`` (over its ipc bus), or at the tcp address its
    ``attach.tcp`` listens on (``tcp://HOST:PORT``; the job's secret must be set here too).
    ``ConfigError`` when no job runs in the folder."""
    return Attached(where)
