"""`pivot run`: start the job's actors over nng ipc:// and show its progress live.

What runs today (and what the output says): rollout and GenRM judging. The Driver and the
rollout and reward Schedulers live in this process; one RoleAgent per CPU device runs in its
own child process: the first devices serve the tiny policy, the last ``reward_devices`` the
tiny GenRM, each on a torch engine. The trainer and live shifting are not wired in yet, so the
policy does not change between steps.
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
from pathlib import Path

import msgspec

import pivot
from pivot.actors.driver import Driver, StepReport
from pivot.actors.messages import rl_messages
from pivot.actors.monitor import Monitor
from pivot.actors.scheduler import Scheduler
from pivot.actors.sources import TaskSource
from pivot.bus import Bus, Directory, RestartPolicy, Supervisor, configure_logging, run_real
from pivot.cli.plot import plot_run
from pivot.cluster import Role
from pivot.config import ConfigError, load_toml
from pivot.cost import CostModel
from pivot.engine import SamplingParams
from pivot.job import JobConfig
from pivot.routing import RouterSettings, make_router
from pivot.timeline import RoleSample, TrainSpan
from pivot.tokenizer import TextCodec

ASSETS = Path(pivot.__file__).resolve().parent / "assets"

# Estimate, not a measurement: per-step cost of the tiny policy on one CPU thread, only used to
# rank replicas by their next inter-token latency (all replicas share it, so it orders by load).
TINY_CPU_COST = CostModel(a=2e-7, b=1e-3, c=5e-5, d=5e-4)


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


def _agent_kwargs(job: JobConfig, directory: Directory, model: Path, role: Role, seed: int) -> dict:
    return {
        "directory": directory.to_dict(),
        "model": str(model),
        "role": role.value,
        "scheduler": f"{role.value}-scheduler",
        "max_running": job.model.max_running,
        "threads": job.cluster.threads_per_device,
        "seed": seed,
    }


async def _run(
    job: JobConfig, policy: Path, genrm: Path | None, run_dir: Path, console
) -> list[StepReport]:
    devices = job.cluster.devices
    reward_devices = job.cluster.reward_devices if genrm is not None else 0
    roles = [Role.ROLLOUT] * (devices - reward_devices) + [Role.REWARD] * reward_devices
    agents = [f"agent-{i}" for i in range(devices)]
    schedulers = ["rollout-scheduler"] + (["reward-scheduler"] if genrm is not None else [])
    names = ["driver", "monitor", *schedulers, *agents]
    # ipc paths must stay under ~100 bytes, so sockets live in a short temporary folder
    sockets = Path(tempfile.mkdtemp(prefix="pivot-"))
    directory = Directory.ipc(sockets, names)
    bus = Bus.nng(directory, rl_messages())
    codec = TextCodec.from_dir(policy)
    metrics = (run_dir / "metrics.jsonl").open("ab")
    timeline = (run_dir / "timeline.jsonl").open("ab")

    def on_sample(samples: list[RoleSample]) -> None:
        for sample in samples:
            timeline.write(msgspec.json.encode(sample) + b"\n")
        timeline.flush()

    def on_step(report: StepReport) -> None:
        metrics.write(msgspec.json.encode(report) + b"\n")
        metrics.flush()
        agree = "" if report.genrm_agreement is None else f"  genrm {report.genrm_agreement:4.2f}"
        console.print(
            f"step {report.step:3d}  reward {report.reward_mean:5.3f}  "
            f"exact {report.accuracy:5.3f}{agree}  {report.samples_per_s:6.1f} samples/s  "
            f"{report.tokens_per_s:6.0f} tok/s"
        )

    def router():
        return make_router(
            RouterSettings(policy="lowest_itl", max_concurrent_per_replica=job.model.max_running),
            TINY_CPU_COST,
        )

    expected = {"rollout-scheduler": roles.count(Role.ROLLOUT)}
    if genrm is not None:
        expected["reward-scheduler"] = reward_devices
    r = job.rollout
    source = TaskSource(
        codec,
        seed=job.seed,
        prompts_per_step=r.prompts_per_step,
        samples_per_prompt=r.samples_per_prompt,
        sampling=SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p
        ),
        judged=genrm is not None,
        judgment_tokens=job.reward.max_new_tokens,
    )
    driver = Driver(
        "driver",
        bus,
        source=source,
        steps=job.steps,
        rollout_scheduler="rollout-scheduler",
        reward_scheduler="reward-scheduler" if genrm is not None else None,
        on_step=on_step,
        replicas=expected,
    )
    once = RestartPolicy(restart="never")
    sup = Supervisor(policy=RestartPolicy(max_restarts=2, window=60.0))
    for scheduler in schedulers:
        role = Role.ROLLOUT if scheduler.startswith("rollout") else Role.REWARD
        sup.add_actor(
            scheduler,
            lambda role=role, scheduler=scheduler: Scheduler(
                scheduler, bus, role=role, router=router(), downstream="driver"
            ),
            policy=once,
        )
    sup.add_actor("driver", lambda: driver, policy=once)
    monitor = Monitor(
        "monitor",
        bus,
        agents=agents,
        schedulers={s.removesuffix("-scheduler"): s for s in schedulers},
        on_sample=on_sample,
        origin=bus.clock.now(),
    )
    sup.add_actor("monitor", lambda: monitor, policy=once)
    for i, (agent, role) in enumerate(zip(agents, roles, strict=True)):
        model = policy if role is Role.ROLLOUT else genrm
        assert model is not None
        sup.add_process(
            agent,
            "pivot.actors.agent:torch_agent",
            kwargs=_agent_kwargs(job, directory, model, role, job.seed * 1000 + i),
            env={"OMP_NUM_THREADS": str(job.cluster.threads_per_device)},
            ready_timeout=120.0,
        )
    sup.install_signal_handlers()
    try:
        await sup.start()
        done = asyncio.ensure_future(driver.finished.wait())
        failed = asyncio.ensure_future(sup.wait())
        await asyncio.wait([done, failed], return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            failed.result()  # raises the escalation
        failed.cancel()
    finally:
        await sup.stop()
        sup.remove_signal_handlers()
        metrics.close()
        timeline.close()
        shutil.rmtree(sockets, ignore_errors=True)
    trains = [
        TrainSpan(
            start=r.started_s + r.seconds - r.train_s - monitor.origin,
            end=r.started_s + r.seconds - monitor.origin,
            version=r.policy_version + 1,
        )
        for r in driver.reports
        if r.train is not None
    ]
    plot_run(
        monitor.samples, [], trains, run_dir / "throughput.png", title=f"pivot run: {run_dir.name}"
    )
    return driver.reports


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    job = load_toml(args.config, JobConfig)
    if args.seed is not None:
        job = msgspec.structs.replace(job, seed=args.seed)
    job.validate(args.config)
    policy = resolve_model(job.model.policy, args.config, "model.policy")
    genrm = (
        resolve_model(job.model.genrm, args.config, "model.genrm")
        if job.reward.kind == "genrm"
        else None
    )
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(soft_wrap=True)
    if genrm is None:
        stages = f"rollout on {job.cluster.devices} CPU devices, scored by the exact checker"
    else:
        r = job.cluster.reward_devices
        stages = (
            f"rollout on {job.cluster.devices - r} and GenRM judging on {r} CPU devices "
            "(static split)"
        )
    console.print(
        f"[bold]pivot run[/bold] {args.config}: {stages}; torch engines, actors over nng ipc://."
        f"\n[yellow]Not yet wired in: the trainer and live shifting, so the policy stays "
        f"fixed.[/yellow]\nrun dir: {run_dir}"
    )
    # actors' JSON logs (ours and the children's, which inherit stderr) go to the run dir
    saved_stderr = os.dup(2)
    log = (run_dir / "actors.log").open("ab")
    os.dup2(log.fileno(), 2)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    configure_logging(os.environ.get("PIVOT_LOG_LEVEL", "info"), stream=sys.stderr)
    started = time.perf_counter()
    try:
        reports = run_real(_run(job, policy, genrm, run_dir, console))
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved_stderr, 2)
        sys.stderr = sys.__stderr__
        log.close()
    wall = time.perf_counter() - started
    samples = sum(r.samples for r in reports)
    console.print(
        f"done: {len(reports)} steps, {samples} samples in {wall:.1f} s; "
        f"metrics in {run_dir / 'metrics.jsonl'}, throughput plot in "
        f"{run_dir / 'throughput.png'}, logs in {run_dir / 'actors.log'}"
    )
    return 0
