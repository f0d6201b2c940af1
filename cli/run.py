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
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pivot.accelerator import cuda_missing
from pivot.account import ACCOUNT, ENGINE, TimeAccount, account
from pivot.actors.assembly import (
    CONTROLLER,
    DRIVER,
    MONITOR,
    SCHEDULERS,
    TRAINER,
    Assembly,
    DriverOptions,
    agent_name,
    assemble,
    trainer_names,
)
from pivot.actors.checkpoints import Checkpoint
from pivot.actors.controller import ControllerSettings
from pivot.actors.driver import Scores, StepReport
from pivot.actors.event_hub import EventHub, initial_devices
from pivot.actors.metering import DeviceMeter
from pivot.actors.monitor import Monitor
from pivot.actors.param_store import job_store_name, remove_orphaned_stores, remove_store
from pivot.actors.processes import ControllerSpec, ProcessBackend, job_launcher
from pivot.actors.sources import FunctionReward, GenRMJudge, PromptSource
from pivot.actors.trainer import restart_text
from pivot.actors.vocabulary import rl_messages
from pivot.assets import ASSETS
from pivot.bus import Bus, Directory, RestartPolicy, Supervisor, configure_logging, run_real
from pivot.bus.codec import job_secret
from pivot.bus.errors import SecretError
from pivot.bus.sockets import make_socket_dir, remove_orphaned_socket_dirs
from pivot.bus.statsfile import BusStatsFile, read_stats_dir, trouble
from pivot.bus.supervisor import ChildDidNotStart, SupervisorEscalation
from pivot.cli.flags import make_dir, not_a_file
from pivot.cli.inputs import EVAL_IDS, Inputs, read_inputs
from pivot.cli.interrupts import Interrupted, signal_of
from pivot.cli.jobfile import RUNNING, STARTING, JobFile
from pivot.cli.live import SHORT_ROLES, LiveView
from pivot.cli.plot import plot_run
from pivot.cli.report import SUMMARY_NAME, ReportError, starting_allocation, write_report
from pivot.cli.resume import (
    check_resumed_config,
    checkpoints_of,
    resume_point,
    rewind,
    timeline_end,
)
from pivot.cli.runconfig import (
    CONFIG_NAME,
    DEFAULT_CONFIG,
    flag_overrides,
    read_header,
    refuse_existing_run,
    write_run_config,
)
from pivot.cli.tracking import NoTracker, Tracker, open_tracker
from pivot.cluster import Role, RoleSpec
from pivot.config import ConfigError, blame_overrides, load_toml
from pivot.deployment import loop_staleness
from pivot.engines.checkpoint import (
    DecoderSpec,
    FallbackSpec,
    ModelShape,
    inspect_checkpoint,
    model_shape,
)
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import TextCodec
from pivot.events import EVENTS_FILE, DeviceMap, JobPhase
from pivot.job import JobConfig
from pivot.memory import estimate_memory, gib
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, make_router
from pivot.prompts import JudgePrompt
from pivot.timeline import RoleSample, ShiftMark, TrainSpan

if TYPE_CHECKING:  # aiohttp loads only for a job that asks for the gateway
    from pivot.actors.gateway import Gateway

# Estimate, not a measurement: the tiny models' per-step cost on one CPU thread. It ranks
# replicas for routing and is the planner's prior; the Controller sees measured latencies.
TINY_CPU_COST = CostModel(a=2e-7, b=1e-3, c=5e-5, d=5e-4)

#: the Controller publishes its latest decision at least this often (and on each change)
DECISIONS_EVERY_S = 5.0

#: The run dir's folder of bus counters, one file per process (docs/metrics.md).
BUS_STATS = "bus"


class MeasuredAccount(TimeAccount, frozen=True, kw_only=True):
    """Where a run's devices' time went from its first step's submission to its last step's
    end, measured (``pivot.account``; docs/metrics.md). ``lost_batches``: agents' segment
    batches that never reached the Monitor (their time counts as idle)."""

    lost_batches: int = 0


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """``RUN/summary.json`` (``SUMMARY_NAME``), written as the run stops: what the run as a
    whole measured (a resumed run's is its last start's)."""

    steps: int  # steps this start ran
    account: MeasuredAccount


def resolve_model(name: str, source: str, key: str) -> Path:
    """A shipped model's name, or a path to a Hugging Face checkpoint folder (a relative path
    from the config file's folder, as every path in a config is)."""
    for candidate in (ASSETS / name, Path(source).parent / name):
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
    return " ".join(f"{SHORT_ROLES.get(r, r)}{n}" for r, n in sorted(allocation.items()) if n)


class Job:
    """One `pivot run`: its deployment assembled over nng ipc://, with the real backend."""

    def __init__(
        self,
        job: JobConfig,
        policy: Path,
        genrm: Path | None,
        inputs: Inputs,
        run_dir: Path,
        console,  # noqa: ANN001 - a rich Console
        view: LiveView | None = None,
        tracker: Tracker | NoTracker | None = None,
        resume: Checkpoint | None = None,
        steps_by_hand: bool = False,
        config: str = "",
    ) -> None:
        self.job = job
        self.config = config  # the config file it was read from, for job.json
        self.steps_by_hand = steps_by_hand
        self.started = asyncio.Event()  # the actors run (``assembly`` is set)
        self._stop = asyncio.Event()
        self.policy = policy
        self.genrm = genrm
        self.inputs = inputs
        # a resumed run: the policy is the checkpoint's, and so is the trainer's state
        self.resume = resume
        if resume is not None:
            self.policy = resume.policy
        self.run_dir = run_dir
        self.console = console
        self.view = view
        self.tracker = tracker or NoTracker()
        self.deployment = job.plan()
        self.layout = job.layout()  # validated: each device's GPU, the trainer's ranks
        self.assembly: Assembly | None = None
        self.monitor: Monitor | None = None  # once the job's actors are made
        self.account: MeasuredAccount | None = None  # once the job stopped after a step
        self.events: EventHub | None = None  # likewise
        self.job_file: JobFile | None = None  # RUN/job.json, once run() starts
        self._gateway: Gateway | None = None  # likewise, with rollout.gateway
        checkpoints = {Role.ROLLOUT: self.policy}
        if self.genrm is not None:
            checkpoints[Role.REWARD] = self.genrm
        # ipc paths must stay under ~100 bytes: sockets live in a short temporary folder; those
        # of runs killed before they could remove theirs go now
        remove_orphaned_socket_dirs()
        remove_orphaned_stores()  # GPS stores of runs killed before they could remove theirs
        self.sockets = make_socket_dir()
        directory = Directory.ipc(self.sockets, self._names())
        if job.attach.tcp:  # the Driver also takes requests from other hosts
            driver_at = directory.lookup(DRIVER)
            directory.add(DRIVER, msgspec.structs.replace(driver_at, also_rep=(job.attach.tcp,)))
        # the children sign with the job's secret when one is set: this process must too
        self.bus = Bus.nng(directory, rl_messages(), secret=job_secret())
        control = job.control
        # the Controller runs in its own process, built from this
        self.controller = ControllerSpec(
            settings=ControllerSettings(
                interval_s=control.interval_s,
                command_timeout_s=control.command_timeout_s,
                planner=control.planner,
                decisions_every_s=DECISIONS_EVERY_S,
            ),
            journal=str(run_dir / "shift.journal"),
            roles={Role.ROLLOUT: RoleSpec(model="policy"), Role.REWARD: RoleSpec(model="genrm")},
            cost_models={Role.ROLLOUT: TINY_CPU_COST, Role.REWARD: TINY_CPU_COST},
        )
        self.backend = ProcessBackend(
            directory,
            checkpoints=checkpoints,
            store=job_store_name(),
            router=lambda role: make_router(
                RouterSettings(
                    policy="lowest_itl", max_concurrent_per_replica=self.job.model.max_running
                ),
                TINY_CPU_COST,
            ),
            max_running=self.job.model.max_running,
            engine=self.job.model.engine,
            layout=self.layout,
            dtype=self.job.model.dtype,
            threads=self.job.cluster.threads_per_device,
            pin_cores=self.job.cluster.pin_cores,
            devices=self.job.cluster.devices,
            seed=self.job.seed,
            training=self.job.training,
            rendezvous_dir=self.sockets,
            resume=resume.trainer if resume is not None else None,
            checkpoint_dir=checkpoints_of(run_dir).root,
            # a rank that dies brings the whole group back (a gloo group cannot lose one)
            trainer_restart=RestartPolicy(
                max_restarts=job.control.trainer_restarts,
                window=job.control.trainer_restart_window_s,
            ),
            controller=self.controller,
        )
        # last, so that nothing here can fail with the server started: ``run`` closes it
        # (it imports while this process builds the job's actors)
        self.launcher = job_launcher(self.layout.accelerator, job.model.engine, checkpoints)

    def stop(self) -> None:
        """End the job now (its steps so far stay as they are): ``run`` stops every actor."""
        self._stop.set()

    def _names(self) -> list[str]:
        d = self.deployment
        return [
            DRIVER,
            MONITOR,
            CONTROLLER,
            *(SCHEDULERS[r] for r in d.roles),
            *(agent_name(device) for device in d.agent_devices),
            *trainer_names(TRAINER, len(self.layout.trainer_devices)),
        ]

    async def run(self) -> tuple[list[StepReport], Monitor]:
        try:
            return await self._run()
        finally:
            # whatever way the job ended, before its Supervisor existed too (a gateway that
            # could not start, an actor that could not be built): what __init__ opened goes
            # (the Supervisor's stop closed the fork server already, if it got that far)
            if self._gateway is not None:
                await self._gateway.close()
            await self.launcher.close()
            await self.bus.close()
            shutil.rmtree(self.sockets, ignore_errors=True)

    async def _run(self) -> tuple[list[StepReport], Monitor]:
        job, run_dir, console, d = self.job, self.run_dir, self.console, self.deployment
        metrics = (run_dir / "metrics.jsonl").open("ab")
        timeline = (run_dir / "timeline.jsonl").open("ab")
        dump = (run_dir / "samples.jsonl").open("ab") if job.log.samples else None
        events = (run_dir / EVENTS_FILE).open("ab")

        def write_events(records) -> None:  # noqa: ANN001 - pivot.events records
            events.write(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
            events.flush()
            if self.view is not None:  # the panel's device map, one cell per device
                for record in records:
                    if isinstance(record, DeviceMap):
                        self.view.on_devices(record.roles)
                    elif isinstance(record, JobPhase) and record.detail:
                        self.view.phase(record.detail)

        hub = self.events = EventHub(
            self.bus.clock.now(),
            steps=self.inputs.steps,
            deployment=d.kind.value,
            devices=initial_devices(d),
            managed=range(d.managed),
            sink=write_events,
        )
        names = self._names()
        job_file = self.job_file = JobFile(
            run_dir,
            state=STARTING,
            sockets=str(self.sockets),
            names=names,
            step=self.resume.state.next_step if self.resume else 0,
            steps=self.inputs.steps,
            deployment=d.kind.value,
            config=self.config,
        )

        def on_step(report: StepReport) -> None:
            metrics.write(msgspec.json.encode(report) + b"\n")
            metrics.flush()
            hub.step(report)
            job_file.update(step=report.step + 1)
            self.tracker.on_step(report)
            if dump is not None:
                dump.flush()
            loss = f" loss {report.train['loss']:+.3f}" if report.train else ""
            if report.trainer_restart is not None:
                console.print(
                    f"    step {report.step}: {restart_text(report.trainer_restart)}",
                    style="yellow",
                )
            if self.view is not None:
                self.view.on_step(
                    report.scores,
                    report.samples_per_s,
                    train=report.train,
                    seconds=report.seconds,
                    train_s=report.train_s,
                )
            console.print(
                f"step {report.step:3d}  {scores_text(report.scores)}{loss}  "
                f"{report.samples_per_s:5.1f} samples/s {report.tokens_per_s:5.0f} tok/s  "
                f"shifts {len(monitor.shifts)}"
            )
            if report.eval is not None:
                console.print(
                    f"    eval ({report.eval.scores.samples} prompts, policy "
                    f"v{report.eval.policy_version}, {report.eval.seconds:.1f} s): "
                    f"{scores_text(report.eval.scores)}",
                    style="green",
                )

        # a resumed run's timeline continues where the stopped one's ended
        offset = timeline_end(run_dir / "timeline.jsonl") if self.resume is not None else 0.0

        def on_sample(samples: list[RoleSample]) -> None:
            samples = [msgspec.structs.replace(s, t=s.t + offset) for s in samples]
            if self.view is not None:
                self.view.on_samples(samples)
            for sample in samples:
                timeline.write(msgspec.json.encode(sample) + b"\n")
            timeline.flush()
            self.tracker.on_samples(samples)

        def on_shift(mark: ShiftMark) -> None:
            mark = msgspec.structs.replace(mark, t=mark.t + offset)
            timeline.write(msgspec.json.encode(mark) + b"\n")
            self.tracker.on_shift(mark)
            if self.view is not None:
                self.view.on_shift(mark)
            if console.is_terminal and self.view is not None:
                return  # the live panel shows shifts; a log gets one line each
            console.print(
                f"    shift ({mark.kind}, {mark.seconds:.2f} s): {_allocation_text(mark.allocation)}",
                style="cyan",
            )

        source, evaluation = self._sources(
            (lambda row: dump.write(msgspec.json.encode(row) + b"\n")) if dump else None
        )
        gateway = None
        if job.rollout.gateway:
            from pivot.actors.gateway import Gateway

            gateway = self._gateway = Gateway(source.codec)
            console.print(f"OpenAI gateway at {await gateway.start()}", style="dim")
        monitor = self.monitor = Monitor(
            MONITOR,
            self.bus,
            agents=[agent_name(device) for device in d.agent_devices],
            schedulers={role.value: SCHEDULERS[role] for role in d.roles},
            on_sample=on_sample,
            on_shift=on_shift,
            controller=CONTROLLER if d.managed else None,
            interval=0.1,
            events=hub,
            trainer=TRAINER if d.trainer_devices else None,
            meter=DeviceMeter(d),
        )
        sup = Supervisor(
            policy=RestartPolicy(max_restarts=2, window=60.0),
            stats_dir=run_dir / BUS_STATS,
            launcher=self.launcher,
        )
        counters = BusStatsFile(self.bus, run_dir / BUS_STATS / "main.json", process="main")
        self.assembly = assemble(
            d,
            self.bus,
            sup,
            backend=self.backend,
            source=source,
            steps=self.inputs.steps,
            driver=DriverOptions(
                staleness=loop_staleness(d.kind, job.rollout.staleness),
                on_step=on_step,
                announce_batches=True,
                wait_for_controller=True,
                evaluation=evaluation,
                eval_every=job.data.eval_every,
                checkpoints=checkpoints_of(
                    run_dir,
                    every=job.checkpoint.every,
                    keep=job.checkpoint.keep,
                    last_step=self.inputs.steps - 1,
                ),
                stall_timeout=job.control.stall_timeout_s,
                rollout=self.inputs.rollout,
                gateway=gateway,
                steps_by_hand=self.steps_by_hand,
                first_step=self.resume.state.next_step if self.resume else 0,
                policy_version=self.resume.state.policy_version if self.resume else 0,
            ),
            control=self.controller.control(),
            watchers=[(MONITOR, lambda: monitor)],
        )
        driver = self.assembly.driver
        first_step = driver.before_first_step

        async def before_first_step() -> None:
            if first_step is not None:
                await first_step()
            hub.phase(self.bus.clock.now(), RUNNING)

        driver.before_first_step = before_first_step
        sup.listen(hub.supervised)
        sup.install_signal_handlers()
        counters.start()
        if self.view is not None:  # start-up phase for the live panel
            self.view.phase(
                f"starting {len(d.agent_devices)} role agents (each loads its models) and "
                f"{len(self.layout.trainer_devices)} trainer ranks (DeepSpeed engine build)"
            )
        state = "failed"  # what an exception on the way says, unless it says otherwise
        try:
            hub.phase(self.bus.clock.now(), STARTING, "starting the job's processes")
            hub.expect_children(
                self.bus.clock.now(),
                [
                    ("starting agents, loading models", [agent_name(v) for v in d.agent_devices]),
                    (
                        "building DeepSpeed",
                        trainer_names(TRAINER, len(self.layout.trainer_devices)),
                    ),
                    ("starting the controller", [CONTROLLER] if d.managed else []),
                ],
            )
            hub.flush()
            job_file.update(state=STARTING)
            try:
                await sup.start()
            except Exception:
                if sup.signalled is not None:  # children stopped by the signal mid-start
                    state = "interrupted"
                    raise Interrupted(sup.signalled) from None
                raise
            tcp = self.bus.transport.directory.lookup(DRIVER).also_rep if job.attach.tcp else ()
            job_file.update(state=RUNNING, **({"tcp": tcp[0]} if tcp else {}))
            hub.phase(self.bus.clock.now(), STARTING, "waiting for replicas")
            self.started.set()
            if self.view is not None:  # start-up phase for the live panel
                self.view.phase("every actor started; step 0's rollouts are generating")
            done = asyncio.ensure_future(driver.finished.wait())
            failed = asyncio.ensure_future(sup.wait())
            stopped = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait([done, failed, stopped], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                failed.result()  # raises the escalation
                if sup.signalled is not None:
                    state = "interrupted"
                    raise Interrupted(sup.signalled)
            failed.cancel()
            stopped.cancel()
            asked = driver.stop_after is not None
            state = "finished" if done.done() and not asked else "stopped"
        except (KeyboardInterrupt, asyncio.CancelledError):
            state = "interrupted"
            raise
        finally:
            # every way out says how it ended, before the slow part of stopping
            job_file.update(state=state)
            hub.phase(self.bus.clock.now(), state)
            try:
                await sup.stop()  # the monitor flushes what it followed as it stops
            finally:
                hub.flush()
                events.close()
            remove_store(self.backend.store)  # the job's: it outlived every trainer rank
            await counters.close()  # the children wrote their final counts as they stopped
            sup.remove_signal_handlers()
            metrics.close()
            self.account = self._account(driver.reports, monitor.device_meter)
            if self.account is not None:
                summary = RunSummary(steps=len(driver.reports), account=self.account)
                (run_dir / SUMMARY_NAME).write_bytes(
                    msgspec.json.format(msgspec.json.encode(summary))
                )
            timeline.close()
            if dump is not None:
                dump.close()
            if isinstance(source.reward, FunctionReward):
                source.reward.close()
        return driver.reports, monitor

    def _account(
        self, reports: Sequence[StepReport], meter: DeviceMeter | None
    ) -> MeasuredAccount | None:
        """The time account of this start's steps, from the first one's submission to the
        end of the last (None: no step ended), with the busy threshold its decode samples
        give (``DeviceMeter.measured_thresholds``)."""
        if not reports or meter is None:
            return None
        window = (reports[0].started_s, max(r.started_s + r.seconds for r in reports))
        priors = {role.value: model for role, model in self.controller.cost_models.items()}
        measured = account(
            meter.ledger,
            window,
            self.deployment.split.gpus,
            thresholds=meter.measured_thresholds(priors, self.job.model.max_running),
        )
        return MeasuredAccount(**msgspec.structs.asdict(measured), lost_batches=meter.lost_batches)

    def _sources(self, sink) -> tuple[PromptSource, PromptSource | None]:  # noqa: ANN001
        """The training prompts and the evaluation set, with the job's reward: one reward
        object serves both, so the GenRM's prompt and a function's pool are made once."""
        job, inputs = self.job, self.inputs
        codec = TextCodec.from_dir(self.policy)
        if job.reward.kind == "genrm":
            reward = GenRMJudge(
                JudgePrompt(
                    TextCodec.from_dir(self.genrm),
                    inputs.judge_text,
                    system_prompt=job.reward.system_prompt,
                ),
                inputs.verdict,
                max_new_tokens=job.reward.max_new_tokens,
            )
        elif job.reward.kind == "function":
            reward = FunctionReward(inputs.reward, timeout_s=job.reward.timeout_s)
        else:
            reward = None
        r = job.rollout
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p
        )
        source = PromptSource(
            codec,
            inputs.stream,
            seed=job.seed,
            prompts_per_step=r.prompts_per_step,
            samples_per_prompt=r.samples_per_prompt,
            sampling=sampling,
            reward=reward,
            checker=inputs.checker,
            sink=sink,
        )
        evaluation = None
        if inputs.evaluation is not None:
            evaluation = PromptSource(
                codec,
                inputs.evaluation,
                seed=job.seed,
                prompts_per_step=len(inputs.evaluation.records),
                samples_per_prompt=1,
                sampling=msgspec.structs.replace(sampling, temperature=job.data.eval_temperature),
                reward=reward,
                checker=inputs.checker,
                id_base=EVAL_IDS,
            )
        return source, evaluation


def write_plot(
    runner: Job | None,
    run_dir: Path,
    kind: str,
    initial: dict[str, int] | None = None,
    fixed: dict[str, int] | None = None,
) -> Path | None:
    """``throughput.png`` of what the job ran so far: its roles' throughput, its shifts and
    when it trained, the allocation as a lane strip from ``initial`` on (None: it never got
    as far as its Monitor)."""
    if runner is None or runner.monitor is None or runner.assembly is None:
        return None
    monitor = runner.monitor
    trains = [
        TrainSpan(
            start=r.started_s + r.seconds - r.train_s - monitor.origin,
            end=r.started_s + r.seconds - monitor.origin,
            version=r.policy_version + 1,
        )
        for r in runner.assembly.driver.reports
        if r.train is not None
    ]
    return plot_run(
        monitor.samples,
        monitor.shifts,
        trains,
        run_dir / "throughput.png",
        title=f"pivot run ({kind}): {run_dir.name}",
        initial=initial,
        fixed=fixed,
    )


def write_outputs(
    runner: Job | None, run_dir: Path, kind: str, allocation: dict[str, int], fixed: dict[str, int]
) -> tuple[Path | None, Path | None]:
    """The plot and ``report.html`` of what ran (each None where it could not be made: a job
    stopped before its Monitor has no plot, one stopped before a step's record no report)."""
    plot = write_plot(runner, run_dir, kind, allocation, fixed)
    report = None
    with contextlib.suppress(ReportError):
        report = write_report(run_dir)
    return plot, report


def account_text(record: MeasuredAccount) -> str:
    """The time account: device-seconds and the share of devices x window of each category,
    then each inference role's engine time and the batch it decoded at."""
    whole = max(record.devices * record.window_s, 1e-12)

    def share(name: str, seconds: float) -> str:
        return f"{name.replace('_', ' ')} {seconds:.1f} s ({100 * seconds / whole:.1f}%)"

    parts = [share(k, record.seconds[k]) for k in ACCOUNT]
    lost = f"; {record.lost_batches} segment batches lost" if record.lost_batches else ""
    busy = ", ".join(f"{role} >= {n}" for role, n in sorted(record.thresholds.items()))
    roles = [
        f"\n  {role}: "
        + ", ".join(share(k, getattr(t, k)) for k in ENGINE)
        + f", decoding {t.decode_batch:.1f} sequences a replica on average"
        for role, t in record.roles.items()
    ]
    return (
        f"device time ({record.devices} devices x {record.window_s:.1f} s, first step to last; "
        f"busy from batch {busy or '-'}{lost}):\n  " + ", ".join(parts) + "".join(roles)
    )


def bus_trouble_line(run_dir: Path) -> str | None:
    """One line of the bus counters that say traffic was lost, refused or late, summed over
    the job's processes (None when all are zero)."""
    folder = run_dir / BUS_STATS
    counts = trouble(read_stats_dir(folder))
    if not counts:
        return None
    return "bus: " + ", ".join(f"{n} {name}" for name, n in counts.items()) + f" (see {folder})"


def scores_text(scores: Scores) -> str:
    """A step's (or an evaluation's) scores in a line: the mean reward over the samples
    scored, the failed rewards and their causes, the checker's accuracy and the GenRM's
    agreement with it where a checker exists, the reward function's own metrics."""
    mean = "-" if scores.reward_mean is None else f"{scores.reward_mean:5.3f}"
    parts = [f"reward {mean}"]
    if scores.reward_failures:
        causes = ", ".join(f"{n} {cause}" for cause, n in scores.failures_by_cause.items())
        parts.append(f"failed {scores.reward_failures}/{scores.samples} ({causes})")
    if scores.accuracy is not None:
        parts.append(f"accuracy {scores.accuracy:5.3f}")
    if scores.genrm_agreement is not None:
        parts.append(f"genrm=checker {scores.genrm_agreement:4.2f}")
    parts.extend(f"{k} {v:.3g}" for k, v in scores.reward_metrics.items())
    return "  ".join(parts)


def _check_attach(job: JobConfig, config: str) -> None:
    address = job.attach.tcp
    if not address:
        return
    if not address.startswith(("tcp://", "tcp4://", "tcp6://")) or ":" not in address[6:]:
        raise ConfigError(config, "attach.tcp", "an address tcp://HOST:PORT", repr(address))
    if job_secret() is None:
        raise ConfigError(
            config,
            "attach.tcp",
            "the job's shared secret for a tcp address (PIVOT_SECRET_FILE)",
            "no secret set",
        )


def prepare(
    config: str,
    *,
    overrides: Sequence[str] = (),
    seed: int | None = None,
    deployment: str | None = None,
    steps: int | None = None,
) -> tuple[JobConfig, Path, Path | None, Inputs]:
    """The job's config with command-line overrides (``key=value``; the flags are overrides
    too, applied last), validated, its model folders, its memory estimate (refused when over
    what this host has available), its data and its reward code, all read before any child
    process starts."""
    overrides = [*overrides, *flag_overrides(seed=seed, deployment=deployment, steps=steps)]
    job = load_toml(config, JobConfig, overrides)
    try:
        job.validate(config)
        check_engine_installed(job, config)
        check_accelerator(job, config)
    except ConfigError as exc:
        raise blame_overrides(exc, overrides) from None
    _check_attach(job, config)
    policy = resolve_model(job.model.policy, config, "model.policy")
    genrm = (
        resolve_model(job.model.genrm, config, "model.genrm")
        if job.reward.kind == "genrm"
        else None
    )
    codecs = {}  # each role's tokenizer, read once by its model's check
    shapes = {}
    for role, folder, key, tokens in (
        (Role.ROLLOUT, policy, "rollout.max_new_tokens", job.rollout.max_new_tokens),
        (Role.REWARD, genrm, "reward.max_new_tokens", job.reward.max_new_tokens),
    ):
        if folder is None:
            continue
        spec, codecs[role] = check_model(folder)
        shapes[role] = model_shape(folder)
        positions = getattr(spec, "max_position_embeddings", None)
        if positions is not None and tokens >= positions:
            raise ConfigError(
                config,
                key,
                f"fewer than the model's {positions} positions (config.json "
                f"max_position_embeddings of {folder}), leaving room for the prompt",
                f"int {tokens}",
            )
    most = 8 * (os.cpu_count() or 1)
    if job.cluster.devices > most:
        raise ConfigError(
            config,
            "cluster.devices",
            f"at most {most} (8 per CPU core here: each device is a process)",
            f"int {job.cluster.devices}",
        )
    check_memory(job, shapes, config)
    inputs = read_inputs(job, config)
    if job.reward.system_prompt and not codecs[Role.REWARD].has_chat_template:
        raise ConfigError(
            config,
            "reward.system_prompt",
            "a GenRM whose tokenizer has a chat template",
            f"none in {genrm}",
        )
    return job, policy, genrm, inputs


def check_engine_installed(job: JobConfig, config: str) -> None:
    """The engine ``model.engine`` names can be imported here (SGLang is an extra)."""
    if job.model.engine != "sglang":
        return
    from pivot.actors.sglang_engine import sglang_missing
    from pivot.actors.sglang_surface import PIN

    missing = sglang_missing()
    if missing is not None:
        raise ConfigError(
            config,
            "model.engine",
            f"'torch', or SGLang {PIN} installed for 'sglang' (the 'gpu' extra, in a venv of "
            "its own: README, 'GPU (SGLang)')",
            f"'sglang' where {missing}",
        )


def check_accelerator(job: JobConfig, config: str) -> None:
    """This host has the GPUs ``cluster.accelerator = "cuda"`` and ``cluster.devices`` (or
    ``cluster.gpus``) ask for (torch is imported only then: the CPU path never asks it)."""
    if job.cluster.accelerator != "cuda":
        return
    import torch

    problem = cuda_missing(
        job.cluster.accelerator,
        job.cluster.devices,
        available=torch.cuda.is_available(),
        count=torch.cuda.device_count(),
        cpu_build=torch.version.cuda is None,
        gpus=job.cluster.gpus,
    )
    if problem is not None:
        raise ConfigError(config, *problem)


def available_memory() -> int | None:
    """Bytes of memory this host can give a new job without swapping (``MemAvailable`` in
    /proc/meminfo); None where the kernel does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_memory(
    job: JobConfig, shapes: dict[Role, ModelShape], config: str, available: int | None = None
) -> None:
    """Refuse a job whose memory estimate (``pivot.memory``) exceeds what this host has
    available, in one line giving the estimate and its largest parts."""
    if available is None:
        available = available_memory()
    estimate = estimate_memory(job, shapes)
    if available is not None and estimate.total > available:
        raise ConfigError(
            config,
            "",
            f"a job that fits in the {gib(available)} of memory available here "
            "(MemAvailable in /proc/meminfo)",
            f"an estimated {estimate.describe()} (pivot.memory)",
        )


def check_model(folder: Path) -> tuple[DecoderSpec | FallbackSpec, TextCodec]:
    """What the agents and the trainer will load, read here first: a folder pivot cannot
    serve is one line naming the file and the key, before any child process starts. The
    tokenizer is the model's own (``AutoTokenizer``): it needs an eos token, and ids that the
    model's embedding holds. Returns the folder's spec and its tokenizer."""
    spec, _ = inspect_checkpoint(folder)
    codec = TextCodec.from_dir(folder)  # a TokenizerError (a ConfigError) names the file
    if spec.vocab_size is not None and codec.vocab_size > spec.vocab_size:
        raise ConfigError(
            str(folder / "tokenizer.json"),
            "",
            f"at most {spec.vocab_size} tokens (config.json vocab_size)",
            f"{codec.vocab_size}",
        )
    return spec, codec


@contextlib.contextmanager
def logs_to(path: Path) -> Iterator[None]:
    """Actors' JSON logs (ours and the children's, which inherit stderr) go to ``path``."""
    saved_stderr, stderr_before = os.dup(2), sys.stderr
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
        sys.stderr = stderr_before  # (a caller's own, such as pytest's capture)
        log.close()


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    try:  # a bad secret file is refused before anything is written or started
        job_secret()
    except SecretError as exc:
        print(f"pivot: {exc}", file=sys.stderr)
        return 2
    overrides = [*args.overrides, *flag_overrides(seed=args.seed, deployment=args.deployment)]
    resume = None
    if args.resume is not None:
        run_dir = Path(args.resume)
        resume = resume_point(run_dir)
        # the run's own config, with the overrides given now (a config file given beside
        # --resume must be that config but for the keys they set)
        config = check_resumed_config(run_dir, args.config, overrides)
    else:
        run_dir = not_a_file(args.run_dir or _default_run_dir(), "--run-dir")
        refuse_existing_run(run_dir)
        config = args.config or DEFAULT_CONFIG
    job, policy, genrm, inputs = prepare(config, overrides=overrides)
    if resume is not None:
        check_model(resume.policy)
        if resume.state.next_step >= inputs.steps:
            print(f"{run_dir}: every step of {inputs.steps} is done; nothing to resume")
            return 0
        cut = rewind(run_dir, resume, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), overrides)
    make_dir(run_dir, "--run-dir")
    if resume is None:
        write_run_config(run_dir, job, config, overrides)
    else:  # the overrides of every start of the run, in order
        first = read_header(run_dir / CONFIG_NAME)
        write_run_config(
            run_dir, job, config, [*first.overrides, *overrides], source=first.source or None
        )
    console = Console(soft_wrap=True)
    c, d = job.cluster, job.deployment
    deployment = job.plan()
    ranks = len(job.layout().trainer_devices)  # one per GPU on cuda
    judge = {
        "genrm": "GenRM judging",
        "function": f"reward {job.reward.function}",
        "exact": "the checker scoring",
    }[job.reward.kind]
    console.print(
        f"[bold]pivot run[/bold] {args.config}: GRPO, {inputs.steps} steps of "
        f"{job.rollout.prompts_per_step}x{job.rollout.samples_per_prompt} samples; {judge}; "
        f"{c.devices} {c.accelerator.upper()} devices ({ranks} trainer ranks, "
        f"ZeRO-{job.training.zero_stage}); "
        f"deployment {d.kind}; torch engines and DeepSpeed over nng ipc://\n{inputs.data_line}\n"
        f"run dir: {run_dir}"
    )
    if resume is not None:
        console.print(
            f"resuming from {resume.folder} (policy v{resume.state.policy_version}) at step "
            f"{resume.state.next_step}"
            + (f"; cut steps {cut} from metrics.jsonl (run again)" if cut else "")
        )
    started = time.perf_counter()
    allocation, fixed = starting_allocation(deployment)
    view = LiveView(inputs.steps, d.kind, allocation, fixed=fixed, clock=time.monotonic)
    view.phase("assembling the job: tokenizers, prompts, actors")
    tracker = open_tracker(run_dir, job.log.tensorboard, allocation=allocation, fixed=view.fixed)
    if resume is not None:
        view.done = resume.state.next_step
    runner: Job | None = None
    try:
        with logs_to(run_dir / "actors.log"):  # the fork server the Job starts logs there too
            runner = Job(
                job, policy, genrm, inputs, run_dir, console, view, tracker, resume, config=config
            )
            with Live(view, console=console, refresh_per_second=4):
                reports, monitor = run_real(runner.run())
    except KeyboardInterrupt as exc:
        # the plot and report of what ran, as a finished run gets; they must not hide the
        # interrupt
        with contextlib.suppress(Exception):
            write_outputs(runner, run_dir, d.kind, allocation, fixed)
        with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
            console.print(
                f"\ninterrupted by {signal_of(exc).name} after {view.done} steps; every child "
                f"stopped; what ran is in {run_dir}"
            )
        raise
    except SupervisorEscalation as exc:
        # a child died and may not come back: say which and why in one line, and how to go on
        with contextlib.suppress(Exception):
            write_outputs(runner, run_dir, d.kind, allocation, fixed)
        latest = checkpoints_of(run_dir).latest()
        after = (
            f"; continue with pivot run --resume {run_dir} (from {latest.folder.name})"
            if latest is not None
            else ""
        )
        console.print(
            f"\nthe job stopped after {view.done} steps: {exc}; what ran is in {run_dir}"
            f" (logs {run_dir / 'actors.log'}){after}",
            style="red",
            soft_wrap=True,
        )
        if (line := bus_trouble_line(run_dir)) is not None:
            console.print(line, style="yellow")
        return 1
    except ChildDidNotStart as exc:
        console.print(
            f"\nthe job did not start: {exc} (logs {run_dir / 'actors.log'})",
            style="red",
            soft_wrap=True,
        )
        return 1
    finally:
        tracker.close()
    console.print()
    wall = time.perf_counter() - started
    plot, report = write_outputs(runner, run_dir, d.kind, allocation, fixed)
    kinds = {}
    for mark in monitor.shifts:
        kinds[mark.kind] = kinds.get(mark.kind, 0) + 1
    first, last = reports[:5], reports[-5:]

    def mean(rs: list[StepReport]) -> str:
        means = [r.scores.reward_mean for r in rs if r.scores.reward_mean is not None]
        return f"{sum(means) / len(means):.3f}" if means else "-"

    failures = sum(r.scores.reward_failures for r in reports)
    failed = f"{failures} rewards failed (see actors.log); " if failures else ""
    repeats = sum(r.duplicates for r in reports) + runner.assembly.driver.unknown_completions
    if repeats:
        console.print(f"{repeats} completions arrived more than once (ignored)", style="yellow")
    stopped = runner.assembly.driver.stop_after
    if stopped is not None:
        console.print(
            "stopped by pivot stop "
            + (f"after step {stopped}" if stopped >= 0 else "at once (the step was abandoned)")
        )
    console.print(
        f"done: {len(reports)} steps in {wall:.1f} s; reward {mean(first)} (first 5 steps) "
        f"-> {mean(last)} (last 5); {failed}shifts {sum(kinds.values())} {kinds}\n"
        f"metrics {run_dir / 'metrics.jsonl'}, plot {plot}, report {report}, "
        + (f"journal {run_dir / 'shift.journal'}, " if d.kind != "disaggregated" else "")
        + f"logs {run_dir / 'actors.log'}"
        + (f", tensorboard --logdir {run_dir / 'tensorboard'}" if job.log.tensorboard else "")
    )
    if runner.account is not None:
        console.print(account_text(runner.account))
    if (line := bus_trouble_line(run_dir)) is not None:
        console.print(line, style="yellow")
    saved = [r.checkpoint for r in reports if r.checkpoint]
    if saved:
        console.print(
            f"checkpoint {saved[-1]} (its policy/ is a Hugging Face folder; continue a stopped "
            f"run with pivot run --resume {run_dir})"
        )
    return 0
