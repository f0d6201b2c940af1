"""The real backend on one host: every agent, every trainer rank and the Controller a
supervised child process, talking nng ipc://. Agents serve Hugging Face checkpoint folders
with pivot's torch engine (one engine per role the agent may serve) and read new policy
versions from the GPS host store; the trainer is a DeepSpeed group (gloo on CPU, one rank
per trainer device; NCCL on CUDA, one rank per GPU of the trainer devices:
``pivot.accelerator``), rank 0 writing each new policy to that store. The Controller's
process can die alone: the supervisor restarts it, and it replays its journal and
reconciles while the job goes on. (A time-sharing baseline's stage policy reads the Driver's open batches, so its
Controller stays in the job's process.)

    ProcessBackend(directory, *, checkpoints, store, router, max_running, threads, seed,
                   training, layout, rendezvous_dir, resume=None, checkpoint_dir=None,
                   trainer_restart=None, controller=None)
    ControllerSpec: what a Controller process is built from (JSON), .control() -> Control
    job_launcher(accelerator, engine, checkpoints)   how the job's children start (begun)
    pin_to_cores(cores)     pins the calling process's threads (a pinned device's children)
    controller_process(name, *, directory, deployment, spec)   its child factory
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from pivot.accelerator import GpuLayout, device_cores
from pivot.actors.assembly import AgentStart, ChildProcess, Control, build_controller
from pivot.actors.controller import Controller, ControllerSettings, open_journal
from pivot.bus import Bus, Directory, RestartPolicy
from pivot.bus.codec import job_secret
from pivot.bus.supervisor import ExecLauncher, Launcher
from pivot.bus.zygote import ZygoteLauncher
from pivot.cluster import Role, RoleSpec
from pivot.deployment import Deployment
from pivot.engines.checkpoint import read_config
from pivot.planning.cost import CostModel
from pivot.planning.routing import Router, RouterSettings
from pivot.training import TrainingSettings

#: What a job's children import before they serve (``job_launcher``'s preload): a role
#: agent, its engines and their checkpoint reader; a trainer rank's DeepSpeed (as it imports
#: it); the Controller's process. The model families' transformers modules are added per job.
PRELOAD = (
    "uvloop",
    "pivot.actors.processes",
    "pivot.actors.agent",
    "pivot.actors.param_store",
    "pivot.engines.torch_engine",
    "pivot.engines.hf_engine",
    "safetensors.torch",
    "pivot.actors.trainer_deepspeed:import_deepspeed",
)

#: An agent process imports torch and loads one engine per role: seconds, more under load.
AGENT_READY_TIMEOUT_S = 180.0
CONTROLLER_READY_TIMEOUT_S = 60.0


def pin_to_cores(cores: list[int]) -> None:
    """Pin every thread of this process, and so every thread it starts, to ``cores``."""
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity(0) moves only the caller
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


class ControllerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A Controller as data, so that a child process can build it: its settings, the
    inference roles' specs, cost models, models and routers, its journal's path, and how
    often its process may be restarted."""

    settings: ControllerSettings
    roles: dict[Role, RoleSpec]
    cost_models: dict[Role, CostModel]
    journal: str
    models: dict[Role, str] | None = None
    routers: dict[Role, RouterSettings] | None = None
    # a Controller restarts in about a second and loses nothing: a few a minute are fine
    restart: RestartPolicy = RestartPolicy(max_restarts=8, window=60.0, backoff=0.5)

    def control(self) -> Control:
        import time

        path = self.journal
        return Control(
            settings=self.settings,
            journal=lambda: open_journal(path),
            roles=self.roles,
            cost_models=self.cost_models,
            models=self.models,
            routers=self.routers,
            timer=time.perf_counter,  # how long planning takes, for the planner's own record
            restart=self.restart,
        )


def job_launcher(accelerator: str, engine: str, checkpoints: Mapping[Role, Path]) -> Launcher:
    """How a job's children start, its server started now (as early as the job may start a
    process, so that its imports overlap the job's own start): on ``cpu`` with pivot's torch
    engine, forked from a server that imported what agents, trainer ranks and the Controller
    import (``PRELOAD`` and the checkpoints' transformers modules; ``pivot.bus.zygote``);
    otherwise each a fresh interpreter (on CUDA, a process forked after DeepSpeed's import
    touched the driver could not use it)."""
    if accelerator != "cpu" or engine != "torch":
        return ExecLauncher()
    families = sorted(
        {read_config(folder).get("model_type") or "" for folder in checkpoints.values()}
    )
    launcher = ZygoteLauncher(
        [*PRELOAD, *(f"transformers.models.{t}.modeling_{t}" for t in families if t)]
    )
    launcher.begin()
    return launcher


def controller_process(
    name: str, *, directory: dict[str, Any], deployment: dict[str, Any], spec: dict[str, Any]
) -> Controller:
    """Factory for the Controller's child process (see ``ControllerSpec``)."""
    from pivot.actors.faults import crashing_journal
    from pivot.actors.vocabulary import rl_messages

    made = msgspec.convert(spec, ControllerSpec, strict=False)
    control = made.control()
    opened = control.journal
    control = dataclasses.replace(control, journal=lambda: crashing_journal(opened()))
    bus = Bus.nng(Directory.from_dict(directory), rl_messages(), secret=job_secret())
    # (JSON made its int keys strings)
    deployment_ = msgspec.convert(deployment, Deployment, strict=False)
    controller = build_controller(deployment_, bus, control)
    assert controller.name == name
    return controller


class ProcessBackend:
    """Agents and trainer ranks as child processes (see the module docstring).

    ``checkpoints``: the checkpoint folder of each inference role the job serves. ``store``:
    the GPS host store's name (the trainer creates it, rollout engines read it).
    ``router``: a fresh router per scheduler start. ``engine``: what agents serve with,
    ``torch`` or ``sglang`` (``model.engine``). ``seed``: the job's; each agent's engines
    sample from ``seed * 1000 + device``. ``rendezvous_dir``: where the trainer ranks meet.
    ``resume``: a checkpoint's trainer state to continue from (the rollout checkpoint is then
    that checkpoint's policy folder). ``checkpoint_dir``: the run's checkpoints, where a
    restarted trainer group looks for the last complete one. ``trainer_restart``: the trainer
    group's restart policy (None: a rank that dies stops the job). ``layout``: the
    accelerator, each job device's GPU, the job devices of the trainer's ranks and each
    agent's SGLang memory share (``JobConfig.layout``). ``dtype``: ``model.dtype``.
    ``pin_cores``: on ``cpu``, each device's agent and trainer rank run on that device's share
    of the cores this process may use (``pivot.accelerator.device_cores`` over ``devices``
    devices), with one torch thread per core of it; the Controller and the job's own process
    are not pinned.
    """

    def __init__(
        self,
        directory: Directory,
        *,
        checkpoints: Mapping[Role, Path],
        store: str,
        router: Callable[[Role], Router],
        max_running: int,
        threads: int,
        seed: int,
        training: TrainingSettings,
        engine: str = "torch",
        layout: GpuLayout,
        dtype: str = "float32",
        rendezvous_dir: Path,
        resume: Path | None = None,
        checkpoint_dir: Path | None = None,
        trainer_restart: RestartPolicy | None = None,
        controller: ControllerSpec | None = None,
        pin_cores: bool = False,
        devices: int | None = None,
    ) -> None:
        if pin_cores and devices is None:
            raise ValueError("pin_cores needs the job's device count (devices)")
        self.directory = directory
        self.checkpoints = dict(checkpoints)
        self.store = store
        self._router = router
        self.max_running = max_running
        self.engine = engine
        self.layout = layout
        self.dtype = dtype
        self.threads = threads
        self.seed = seed
        self.training = training
        self.rendezvous_dir = rendezvous_dir
        self.resume = resume
        self.checkpoint_dir = checkpoint_dir
        self.trainer_restart = trainer_restart
        self.controller_spec = controller
        self._cores = (
            sorted(os.sched_getaffinity(0)) if pin_cores and layout.accelerator == "cpu" else None
        )
        self.devices = devices

    def cores(self, device: int) -> list[int] | None:
        """The cores ``device``'s processes are pinned to (None: not pinned)."""
        if self._cores is None or self.devices is None:
            return None
        return list(device_cores(device, self.devices, self._cores))

    def _threads(self, cores: list[int] | None) -> int:
        return len(cores) if cores else self.threads

    def router(self, role: Role) -> Router:
        return self._router(role)

    def controller(self, deployment: Deployment) -> ChildProcess | None:
        spec = self.controller_spec
        if spec is None or deployment.policy != "planner":
            return None
        return ChildProcess(
            target="pivot.actors.processes:controller_process",
            kwargs={
                "directory": self.directory.to_dict(),
                "deployment": msgspec.to_builtins(deployment),
                "spec": msgspec.to_builtins(spec),
            },
            env={"OMP_NUM_THREADS": "1"},
            ready_timeout=CONTROLLER_READY_TIMEOUT_S,
            policy=spec.restart,
            after_earlier=True,  # its recovery asks every agent what it holds
        )

    def agent(self, agent: AgentStart) -> ChildProcess:
        cores = self.cores(agent.device)
        threads = self._threads(cores)
        return ChildProcess(
            target="pivot.actors.agent:torch_agent",
            kwargs={
                "directory": self.directory.to_dict(),
                "role": agent.role.value,
                "scheduler": agent.scheduler,
                "replica": agent.replica,
                "devices": list(agent.devices) or None,
                "checkpoints": {r.value: str(self.checkpoints[r]) for r in agent.engine_roles},
                "stores": {Role.ROLLOUT.value: self.store},
                "device": agent.device,
                "max_running": self.max_running,
                "engine": self.engine,
                "accelerator": self.layout.accelerator,
                "gpu": self.layout.gpu(agent.device),
                "mem_fraction": self.layout.mem_fraction.get(agent.device),
                "dtype": self.dtype,
                "threads": threads,
                "seed": self.seed * 1000 + agent.device,
                "cores": cores,
                "peers": list(agent.peers),
            },
            env={"OMP_NUM_THREADS": str(threads)},
            ready_timeout=AGENT_READY_TIMEOUT_S,
        )

    def trainer(
        self, name: str, deployment: Deployment, controller: str | None
    ) -> list[tuple[str, ChildProcess]]:
        from pivot.actors.trainer_deepspeed import trainer_group

        # the layout's trainer ranks are its trainer devices, one per GPU
        cores = [self.cores(d) for d in self.layout.trainer_devices]
        return trainer_group(
            name,
            directory=self.directory,
            checkpoint=self.checkpoints[Role.ROLLOUT],
            world_size=len(self.layout.trainer_devices),
            accelerator=self.layout.accelerator,
            gpus=self.layout.trainer_gpus,
            dtype=self.dtype,
            run_dir=self.rendezvous_dir,
            store_name=self.store,
            settings=self.training,
            threads=self._threads(cores[0]) if cores else self.threads,
            cores=cores if self._cores is not None else None,
            controller=controller,
            resume=self.resume,
            checkpoints=self.checkpoint_dir,
            policy=self.trainer_restart,
        )
