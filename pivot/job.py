"""The job's configuration: one nested ConfigStruct per component, read from a TOML file.

Every field has the default of the tiny CPU job (``configs/tiny.toml``), so a config file
only states what it changes. Constraints are part of the types, so a bad value is reported
with the file, the key, what was expected and what was found; ``JobConfig.validate`` checks
the rules that span sections.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pivot.config import ConfigError, ConfigStruct
from pivot.grpo import TrainingSettings
from pivot.planner import PlannerSettings

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Probability = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seconds = Annotated[float, msgspec.Meta(gt=0.0)]

Deployment = Literal["pivot", "disaggregated"]


class ClusterSection(ConfigStruct):
    """CPU "devices": one role-agent process per device, torch pinned to its threads.

    The last ``trainer_devices`` form the trainer pool (one DeepSpeed rank each); the others
    are the shared pool of rollout and reward replicas.
    """

    devices: Positive = 4
    threads_per_device: Positive = 1
    trainer_devices: Positive = 2


class DeploymentSection(ConfigStruct):
    """``pivot``: the Controller shifts shared devices between rollout and reward and lends
    the trainer pool to inference while the trainer waits; ``disaggregated``: fixed pools.
    ``rollout_devices`` of the shared pool serve rollout (at the start, under pivot), the
    rest serve the GenRM."""

    kind: Deployment = "pivot"
    rollout_devices: Positive = 1


class ModelSection(ConfigStruct):
    """Hugging Face checkpoint folders; a bare name is one of the models pivot ships."""

    policy: str = "tiny-policy"
    genrm: str = "tiny-genrm"
    max_running: Positive = 32


class RolloutSection(ConfigStruct):
    prompts_per_step: Positive = 16
    samples_per_prompt: Positive = 4
    max_new_tokens: Positive = 32
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    top_p: Probability = 1.0


class RewardSection(ConfigStruct):
    """``genrm``: the GenRM judges each response; ``exact``: the task's checker scores it."""

    kind: Literal["genrm", "exact"] = "genrm"
    max_new_tokens: Positive = 24


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

    seed: NonNegative = 0
    steps: Positive = 20
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
        most = self.shared_devices - (1 if judged and d.kind == "disaggregated" else 0)
        if d.rollout_devices > most:
            why = "leaving one for the GenRM" if most < self.shared_devices else ""
            raise ConfigError(
                source,
                "deployment.rollout_devices",
                f"at most {most} (the shared devices: cluster.devices - cluster.trainer_devices"
                f"{', ' + why if why else ''})",
                f"int {d.rollout_devices}",
            )
        if self.training.temperature != self.rollout.temperature:
            raise ConfigError(
                source,
                "training.temperature",
                f"the rollout's sampling temperature, {self.rollout.temperature}",
                f"float {self.training.temperature}",
            )
        return self
