"""The job's configuration: one nested ConfigStruct per component, read from a TOML file.

Every field has the default of the tiny CPU job (``configs/tiny.toml``), so a config file
only states what it changes. Constraints are part of the types, so a bad value is reported
with the file, the key, what was expected and what was found; ``JobConfig.validate`` checks
the rules that span sections.
"""

from __future__ import annotations

from typing import Literal

from pivot.cluster import Role
from pivot.config import (
    ConfigError,
    ConfigStruct,
    Fraction,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seconds,
)
from pivot.deployment import Deployment, DeploymentKind, Split, plan_deployment
from pivot.planning.planner import PlannerSettings
from pivot.training import TrainingSettings


class ClusterSection(ConfigStruct):
    """CPU "devices": one role-agent process per device, torch pinned to its threads.

    The last ``trainer_devices`` form the trainer pool (one DeepSpeed rank each); the others
    are the shared pool of rollout and reward replicas.
    """

    devices: PositiveInt = 4
    threads_per_device: PositiveInt = 1
    trainer_devices: PositiveInt = 2


class DeploymentSection(ConfigStruct):
    """How devices serve the roles; every kind runs the same actors.

    * ``pivot``: the Controller's planner shifts shared devices between rollout and reward
      and lends the trainer pool to inference while the trainer waits for a batch.
    * ``disaggregated``: fixed pools: ``rollout_devices`` of the shared devices serve
      rollout, the rest the GenRM; the trainer pool only trains.
    * ``rr-colocated``: the shared devices serve rollout, then (once rollout has drained)
      the GenRM, every step; the trainer pool only trains.
    * ``colocated``: every device serves each stage in turn (rollout, GenRM, training; the
      trainer has one rank per device), as verl and OpenRLHF's colocated modes do.

    ``rollout_devices``: under pivot, the shared devices serving rollout at the start.
    """

    kind: DeploymentKind = DeploymentKind.PIVOT
    rollout_devices: PositiveInt = 1


class ModelSection(ConfigStruct):
    """Hugging Face checkpoint folders; a bare name is one of the models pivot ships."""

    policy: str = "tiny-policy"
    genrm: str = "tiny-genrm"
    max_running: PositiveInt = 32


class RolloutSection(ConfigStruct):
    prompts_per_step: PositiveInt = 16
    samples_per_prompt: PositiveInt = 4
    max_new_tokens: PositiveInt = 32
    temperature: PositiveFloat = 1.0
    top_p: Fraction = 1.0


class RewardSection(ConfigStruct):
    """``genrm``: the GenRM judges each response; ``exact``: the task's checker scores it."""

    kind: Literal["genrm", "exact"] = "genrm"
    max_new_tokens: PositiveInt = 24


class ControlSection(ConfigStruct):
    """The Controller's pace. The paper's constants (60 s horizon, 10 s cooldown) are for
    steps of minutes; the tiny job's steps take seconds, so its defaults are scaled down."""

    interval_s: Seconds = 0.1
    command_timeout_s: Seconds = 60.0
    planner: PlannerSettings = PlannerSettings(
        horizon_s=4.0, cooldown_s=0.3, immunity_s=0.3, migrate_time_init_s=0.3
    )


class JobConfig(ConfigStruct):
    """The whole job."""

    seed: NonNegativeInt = 0
    steps: PositiveInt = 20
    cluster: ClusterSection = ClusterSection()
    deployment: DeploymentSection = DeploymentSection()
    model: ModelSection = ModelSection()
    rollout: RolloutSection = RolloutSection()
    reward: RewardSection = RewardSection()
    training: TrainingSettings = TrainingSettings()
    control: ControlSection = ControlSection()

    @property
    def shared_devices(self) -> int:
        return self.cluster.devices - self.cluster.trainer_devices

    def plan(self) -> Deployment:
        """Which devices train, which host a role agent, and what each starts as: one CPU
        "device" per replica, the last ``trainer_devices`` the trainer pool (colocated: every
        device, one DeepSpeed rank each)."""
        kind, n = DeploymentKind(self.deployment.kind), self.cluster.devices
        shared, training = self.shared_devices, self.cluster.trainer_devices
        rollout = self.deployment.rollout_devices
        if kind is DeploymentKind.DISAGGREGATED:
            split = Split(
                kind=kind, gpus=n, rollout=rollout, reward=shared - rollout, training=training
            )
        elif kind is DeploymentKind.COLOCATED:
            split = Split(kind=kind, gpus=n, shared=n, training=n)
        elif kind is DeploymentKind.RR_COLOCATED:
            split = Split(kind=kind, gpus=n, shared=shared, training=training)
        else:
            split = Split(kind=kind, gpus=n, rollout=rollout, shared=shared, training=training)
        return plan_deployment(
            split,
            {Role.ROLLOUT: 1, Role.REWARD: 1},
            devices_per_host=n,  # one host: the CPU's
            judged=self.reward.kind == "genrm",
            pool_held=False,
        )

    def validate(self, source: str) -> JobConfig:
        """Rules across sections; a violation names the key like a type error does."""
        c, d = self.cluster, self.deployment
        if c.trainer_devices >= c.devices:
            raise ConfigError(
                source,
                "cluster.trainer_devices",
                f"fewer than cluster.devices = {c.devices} (inference needs shared devices)",
                f"int {c.trainer_devices}",
            )
        judged = self.reward.kind == "genrm"
        if d.kind not in (DeploymentKind.PIVOT, DeploymentKind.DISAGGREGATED):
            return self._check_temperature(source)
        most = self.shared_devices - (1 if judged and d.kind is DeploymentKind.DISAGGREGATED else 0)
        if d.rollout_devices > most:
            why = "leaving one for the GenRM" if most < self.shared_devices else ""
            raise ConfigError(
                source,
                "deployment.rollout_devices",
                f"at most {most} (the shared devices: cluster.devices - cluster.trainer_devices"
                f"{', ' + why if why else ''})",
                f"int {d.rollout_devices}",
            )
        return self._check_temperature(source)

    def _check_temperature(self, source: str) -> JobConfig:
        if self.training.temperature != self.rollout.temperature:
            raise ConfigError(
                source,
                "training.temperature",
                f"the rollout's sampling temperature, {self.rollout.temperature}",
                f"float {self.training.temperature}",
            )
        return self
