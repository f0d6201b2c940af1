"""`pivot run`: a real GRPO job with a generative reward model, its actors over nng ipc://.

Processes: one RoleAgent per CPU device (each holds a torch engine for the policy and one for
the GenRM, so it can serve either role), one DeepSpeed rank per trainer-pool device, and in
this process the Driver, the rollout and reward Schedulers, the Controller (deployment
``pivot``) and a Monitor. The trainer writes each new policy to the GPS host store; rollout
replicas read it before serving the next step. Under ``pivot`` the Controller shifts shared
devices between rollout and reward and lends the trainer pool to inference while the trainer
waits; under ``disaggregated`` the pools stay fixed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from pivot.actors.assembly import (
    CONTROLLER,
    DRIVER,
    MONITOR,
    SCHEDULERS,
    TRAINER,
    Assembly,
    Control,
    DriverOptions,
    agent_name,
    assemble,
    trainer_names,
)
from pivot.actors.controller import ControllerSettings, open_journal
from pivot.actors.driver import StepReport
from pivot.actors.monitor import Monitor
from pivot.actors.processes import ProcessBackend
from pivot.actors.sources import TaskSource
from pivot.actors.vocabulary import rl_messages
from pivot.assets import ASSETS
from pivot.bus import Bus, Directory, RestartPolicy, Supervisor, configure_logging, run_real
from pivot.cli.live import LiveView
from pivot.cli.plot import plot_run
from pivot.cluster import Role, RoleSpec
from pivot.config import ConfigError, load_toml
from pivot.deployment import DeploymentKind
from pivot.engines.checkpoint import inspect_checkpoint
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import SPECIAL_TOKENS, TextCodec
from pivot.job import JobConfig
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, make_router
from pivot.timeline import RoleSample, ShiftMark, TrainSpan

# Estimate, not a measurement: the tiny models' per-step cost on one CPU thread. It ranks
# replicas for routing and is the planner's prior; the Controller sees measured latencies.
TINY_CPU_COST = CostModel(a=2e-7, b=1e-3, c=5e-5, d=5e-4)

_SHORT = {"rollout": "RO", "reward": "RM", "training": "TR"}


def resolve_model(name: str, source: str, key: str) -> Path:
    """A shipped model's name, or a path to a Hugging Face checkpoint folder."""
    for candidate in (ASSETS / name, Path(name)):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    shipped = sorted(
        p.name
        for p in (ASSETS.iterdir() if ASSETS.is_dir() else ())
        if (p / "config.json").is_file()
    )
    raise ConfigError(
        source,
        key,
        f"a shipped model ({', '.join(shipped) or 'none'}) or a folder with config.json",
        repr(name),
    )


def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _allocation_text(allocation: dict[str, int]) -> str:
    return " ".join(f"{_SHORT.get(r, r)}{n}" for r, n in sorted(allocation.items()) if n)


class Job:
    """One `pivot run`: its deployment assembled over nng ipc://, with the real backend."""

    def __init__(
        self,
        job: JobConfig,
        policy: Path,
        genrm: Path | None,
        run_dir: Path,
        console,  # noqa: ANN001 - a rich Console
        view: LiveView | None = None,
    ) -> None:
        self.job = job
        self.policy = policy
        self.genrm = genrm
        self.run_dir = run_dir
        self.console = console
        self.view = view
        self.deployment = job.plan()
        self.assembly: Assembly | None = None
        # ipc paths must stay under ~100 bytes: sockets live in a short temporary folder
        self.sockets = Path(tempfile.mkdtemp(prefix="pivot-"))
        directory = Directory.ipc(self.sockets, self._names())
        self.bus = Bus.nng(directory, rl_messages())
        checkpoints = {Role.ROLLOUT: self.policy}
        if self.genrm is not None:
            checkpoints[Role.REWARD] = self.genrm
        self.backend = ProcessBackend(
            directory,
            checkpoints=checkpoints,
            store=f"pivot-gps-{os.getpid()}",
            router=lambda role: make_router(
                RouterSettings(
                    policy="lowest_itl", max_concurrent_per_replica=self.job.model.max_running
                ),
                TINY_CPU_COST,
            ),
            max_running=self.job.model.max_running,
            threads=self.job.cluster.threads_per_device,
            seed=self.job.seed,
            training=self.job.training,
            rendezvous_dir=self.sockets,
        )

    def _names(self) -> list[str]:
        d = self.deployment
        return [
            DRIVER,
            MONITOR,
            CONTROLLER,
            *(SCHEDULERS[r] for r in d.roles),
            *(agent_name(device) for device in d.agent_devices),
            *trainer_names(TRAINER, len(d.trainer_devices)),
        ]

    async def run(self) -> tuple[list[StepReport], Monitor]:
        job, run_dir, console, d = self.job, self.run_dir, self.console, self.deployment
        metrics = (run_dir / "metrics.jsonl").open("ab")
        timeline = (run_dir / "timeline.jsonl").open("ab")
        codec = TextCodec.from_dir(self.policy)

        def on_step(report: StepReport) -> None:
            metrics.write(msgspec.json.encode(report) + b"\n")
            metrics.flush()
            # the GenRM's agreement with the exact checker (only where both judge), and the
            # judgments it wrote with no readable verdict: they scored 0, and say so
            agree = (
                ""
                if report.genrm_agreement is None
                else f" genrm=exact {report.genrm_agreement:4.2f}"
            )
            if report.malformed_judgments:
                agree += f" malformed {report.malformed_judgments}"
            loss = f" loss {report.train['loss']:+.3f}" if report.train else ""
            if self.view is not None:
                self.view.on_step(report.reward_mean, report.samples_per_s)
            console.print(
                f"step {report.step:3d}  reward {report.reward_mean:5.3f}  exact "
                f"{report.accuracy:5.3f}{agree}{loss}  {report.samples_per_s:5.1f} samples/s "
                f"{report.tokens_per_s:5.0f} tok/s  shifts {len(monitor.shifts)}"
            )

        def on_sample(samples: list[RoleSample]) -> None:
            if self.view is not None:
                self.view.on_samples(samples)
            for sample in samples:
                timeline.write(msgspec.json.encode(sample) + b"\n")
            timeline.flush()

        def on_shift(mark: ShiftMark) -> None:
            timeline.write(msgspec.json.encode(mark) + b"\n")
            if self.view is not None:
                self.view.on_shift(mark)
            if console.is_terminal and self.view is not None:
                return  # the live panel shows shifts; a log gets one line each
            console.print(
                f"    shift ({mark.kind}, {mark.seconds:.2f} s): {_allocation_text(mark.allocation)}",
                style="cyan",
            )

        r = job.rollout
        source = TaskSource(
            codec,
            seed=job.seed,
            prompts_per_step=r.prompts_per_step,
            samples_per_prompt=r.samples_per_prompt,
            sampling=SamplingParams(
                max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p
            ),
            judged=self.genrm is not None,
            judgment_tokens=job.reward.max_new_tokens,
            judge_codec=TextCodec.from_dir(self.genrm) if self.genrm is not None else None,
        )
        monitor = Monitor(
            MONITOR,
            self.bus,
            agents=[agent_name(device) for device in d.agent_devices],
            schedulers={role.value: SCHEDULERS[role] for role in d.roles},
            on_sample=on_sample,
            on_shift=on_shift,
            controller=CONTROLLER if d.managed else None,
            interval=0.1,
        )
        control = self.job.control
        sup = Supervisor(policy=RestartPolicy(max_restarts=2, window=60.0))
        self.assembly = assemble(
            d,
            self.bus,
            sup,
            backend=self.backend,
            source=source,
            steps=job.steps,
            driver=DriverOptions(on_step=on_step, announce_batches=True, wait_for_controller=True),
            control=Control(
                settings=ControllerSettings(
                    interval_s=control.interval_s,
                    command_timeout_s=control.command_timeout_s,
                    planner=control.planner,
                ),
                journal=lambda: open_journal(run_dir / "shift.journal"),
                roles={
                    Role.ROLLOUT: RoleSpec(model="policy"),
                    Role.REWARD: RoleSpec(model="genrm"),
                },
                cost_models={Role.ROLLOUT: TINY_CPU_COST, Role.REWARD: TINY_CPU_COST},
                timer=time.perf_counter,
            ),
            watchers=[(MONITOR, lambda: monitor)],
        )
        driver = self.assembly.driver
        sup.install_signal_handlers()
        try:
            try:
                await sup.start()
            except Exception:
                if sup.signalled is not None:  # children stopped by the signal mid-start
                    raise KeyboardInterrupt from None
                raise
            done = asyncio.ensure_future(driver.finished.wait())
            failed = asyncio.ensure_future(sup.wait())
            await asyncio.wait([done, failed], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                failed.result()  # raises the escalation
                if sup.signalled is not None:
                    raise KeyboardInterrupt
            failed.cancel()
        finally:
            await sup.stop()
            await self.bus.close()
            sup.remove_signal_handlers()
            metrics.close()
            timeline.close()
            shutil.rmtree(self.sockets, ignore_errors=True)
        return driver.reports, monitor


def prepare(
    config: str, *, seed: int | None = None, deployment: str | None = None
) -> tuple[JobConfig, Path, Path | None]:
    """The job's config with command-line overrides, validated, and its model folders."""
    job = load_toml(config, JobConfig)
    if seed is not None:
        job = msgspec.structs.replace(job, seed=seed)
    if deployment is not None:
        job = msgspec.structs.replace(
            job, deployment=msgspec.structs.replace(job.deployment, kind=DeploymentKind(deployment))
        )
    job.validate(config)
    policy = resolve_model(job.model.policy, config, "model.policy")
    genrm = (
        resolve_model(job.model.genrm, config, "model.genrm")
        if job.reward.kind == "genrm"
        else None
    )
    for folder in (policy, genrm):
        if folder is not None:
            check_model(folder)
    return job, policy, genrm


def check_model(folder: Path) -> None:
    """What the agents and the trainer will load, read here first: a folder neither pivot's
    engine nor its transformers fallback serves (``inspect_checkpoint``) is one line naming
    the file and the key, before any child process starts."""
    inspect_checkpoint(folder)
    try:
        TextCodec.from_dir(folder)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            str(folder / "tokenizer.json"),
            "",
            f"pivot's character tokenizer (with the tokens {', '.join(SPECIAL_TOKENS)})",
            str(exc),
        ) from None


@contextlib.contextmanager
def logs_to(path: Path) -> Iterator[None]:
    """Actors' JSON logs (ours and the children's, which inherit stderr) go to ``path``."""
    saved_stderr = os.dup(2)
    log = path.open("ab")
    os.dup2(log.fileno(), 2)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    configure_logging(os.environ.get("PIVOT_LOG_LEVEL", "info"), stream=sys.stderr)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        sys.stderr = sys.__stderr__
        log.close()


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    job, policy, genrm = prepare(args.config, seed=args.seed, deployment=args.deployment)
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(soft_wrap=True)
    c, d = job.cluster, job.deployment
    deployment = job.plan()
    ranks = len(deployment.trainer_devices)
    judge = "GenRM judging" if genrm is not None else "the exact checker scoring"
    console.print(
        f"[bold]pivot run[/bold] {args.config}: GRPO, {job.steps} steps of "
        f"{job.rollout.prompts_per_step}x{job.rollout.samples_per_prompt} samples; {judge}; "
        f"{c.devices} CPU devices ({ranks} trainer ranks, ZeRO-{job.training.zero_stage}); "
        f"deployment {d.kind}; torch engines and DeepSpeed over nng ipc://\nrun dir: {run_dir}"
    )
    started = time.perf_counter()
    allocation: dict[str, int] = {"training": ranks}
    for device in deployment.agent_devices:
        placed = deployment.placement(device)
        if placed is not None and placed.role is not Role.TRAINING:
            allocation[placed.role.value] = allocation.get(placed.role.value, 0) + 1
    view = LiveView(
        job.steps, d.kind, allocation, fixed={} if deployment.lends_trainer else {"training": ranks}
    )
    runner = Job(job, policy, genrm, run_dir, console, view)
    try:
        with logs_to(run_dir / "actors.log"), Live(view, console=console, refresh_per_second=4):
            reports, monitor = run_real(runner.run())
    except KeyboardInterrupt:
        console.print(
            f"\ninterrupted after {len(view.rewards)} steps; every child stopped; "
            f"what ran is in {run_dir}"
        )
        raise
    console.print()
    wall = time.perf_counter() - started
    trains = [
        TrainSpan(
            start=r.started_s + r.seconds - r.train_s - monitor.origin,
            end=r.started_s + r.seconds - monitor.origin,
            version=r.policy_version + 1,
        )
        for r in reports
        if r.train is not None
    ]
    plot = plot_run(
        monitor.samples,
        monitor.shifts,
        trains,
        run_dir / "throughput.png",
        title=f"pivot run ({d.kind}): {run_dir.name}",
    )
    kinds = {}
    for mark in monitor.shifts:
        kinds[mark.kind] = kinds.get(mark.kind, 0) + 1
    first, last = reports[:5], reports[-5:]

    def mean(rs: list[StepReport]) -> float:
        return sum(r.reward_mean for r in rs) / max(len(rs), 1)

    repeats = sum(r.duplicates for r in reports) + runner.assembly.driver.unknown_completions
    if repeats:
        console.print(f"{repeats} completions arrived more than once (ignored)", style="yellow")
    console.print(
        f"done: {len(reports)} steps in {wall:.1f} s; reward {mean(first):.3f} (first 5 steps) "
        f"-> {mean(last):.3f} (last 5); shifts {sum(kinds.values())} {kinds}\n"
        f"metrics {run_dir / 'metrics.jsonl'}, plot {plot}, "
        + (f"journal {run_dir / 'shift.journal'}, " if d.kind != "disaggregated" else "")
        + f"logs {run_dir / 'actors.log'}"
    )
    return 0
