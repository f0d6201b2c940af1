"""The real backend on one host: every agent and every trainer rank a supervised child
process, talking nng ipc://. Agents serve Hugging Face checkpoint folders with pivot's torch
engine (one engine per role the agent may serve) and read new policy versions from the GPS
host store; the trainer is a DeepSpeed group on gloo, one rank per trainer device, rank 0
writing each new policy to that store.

    ProcessBackend(directory, *, checkpoints, store, router, max_running, threads, seed,
                   training, rendezvous_dir, resume=None, checkpoint_dir=None,
                   trainer_restart=None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from pivot.actors.assembly import AgentStart, ChildProcess
from pivot.bus import Directory, RestartPolicy
from pivot.cluster import Role
from pivot.deployment import Deployment
from pivot.planning.routing import Router
from pivot.training import TrainingSettings

#: An agent process imports torch and loads one engine per role: seconds, more under load.
AGENT_READY_TIMEOUT_S = 180.0


class ProcessBackend:
    """Agents and trainer ranks as child processes (see the module docstring).

    ``checkpoints``: the checkpoint folder of each inference role the job serves. ``store``:
    the GPS host store's name (the trainer creates it, rollout engines read it).
    ``router``: a fresh router per scheduler start. ``seed``: the job's; each agent's engines
    sample from ``seed * 1000 + device``. ``rendezvous_dir``: where the trainer ranks meet.
    ``resume``: a checkpoint's trainer state to continue from (the rollout checkpoint is then
    that checkpoint's policy folder). ``checkpoint_dir``: the run's checkpoints, where a
    restarted trainer group looks for the last complete one. ``trainer_restart``: the trainer
    group's restart policy (None: a rank that dies stops the job).
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
        rendezvous_dir: Path,
        resume: Path | None = None,
        checkpoint_dir: Path | None = None,
        trainer_restart: RestartPolicy | None = None,
    ) -> None:
        self.directory = directory
        self.checkpoints = dict(checkpoints)
        self.store = store
        self._router = router
        self.max_running = max_running
        self.threads = threads
        self.seed = seed
        self.training = training
        self.rendezvous_dir = rendezvous_dir
        self.resume = resume
        self.checkpoint_dir = checkpoint_dir
        self.trainer_restart = trainer_restart

    def router(self, role: Role) -> Router:
        return self._router(role)

    def agent(self, agent: AgentStart) -> ChildProcess:
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
                "threads": self.threads,
                "seed": self.seed * 1000 + agent.device,
            },
            env={"OMP_NUM_THREADS": str(self.threads)},
            ready_timeout=AGENT_READY_TIMEOUT_S,
        )

    def trainer(
        self, name: str, deployment: Deployment, controller: str | None
    ) -> list[tuple[str, ChildProcess]]:
        from pivot.actors.trainer_deepspeed import trainer_group

        return trainer_group(
            name,
            directory=self.directory,
            checkpoint=self.checkpoints[Role.ROLLOUT],
            world_size=len(deployment.trainer_devices),
            run_dir=self.rendezvous_dir,
            store_name=self.store,
            settings=self.training,
            threads=self.threads,
            controller=controller,
            resume=self.resume,
            checkpoints=self.checkpoint_dir,
            policy=self.trainer_restart,
        )
