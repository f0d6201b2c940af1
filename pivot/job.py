"""The job's configuration: one nested ConfigStruct per component, read from a TOML file.

Every field has the default of the tiny CPU job (``configs/tiny.toml``), so a config file
only states what it changes. Constraints are part of the types, so a bad value is reported
with the file, the key, what was expected and what was found.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pivot.config import ConfigStruct

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Probability = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]


class ClusterSection(ConfigStruct):
    """CPU "devices": one role-agent process per device, torch pinned to one thread each."""

    devices: Positive = 4
    threads_per_device: Positive = 1
    # the static split until the Controller moves devices: the first ones serve rollout
    reward_devices: NonNegative = 2


class ModelSection(ConfigStruct):
    """Hugging Face checkpoint folders; a bare name is one of the models pivot ships."""

    policy: str = "tiny-policy"
    genrm: str = "tiny-genrm"
    max_running: Positive = 32


class RolloutSection(ConfigStruct):
    prompts_per_step: Positive = 16
    samples_per_prompt: Positive = 4
    max_new_tokens: Positive = 32
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Probability = 1.0


class RewardSection(ConfigStruct):
    """``genrm``: the GenRM judges each response; ``exact``: the task's checker scores it."""

    kind: Literal["genrm", "exact"] = "genrm"
    max_new_tokens: Positive = 24


class JobConfig(ConfigStruct):
    """The whole job. ``validate()`` checks what spans sections."""

    seed: NonNegative = 0
    steps: Positive = 20
    cluster: ClusterSection = ClusterSection()
    model: ModelSection = ModelSection()
    rollout: RolloutSection = RolloutSection()
    reward: RewardSection = RewardSection()

    def validate(self, source: str) -> JobConfig:
        """Rules across sections; a violation names the key like a type error does."""
        from pivot.config import ConfigError

        c = self.cluster
        if self.reward.kind == "genrm" and not 1 <= c.reward_devices < c.devices:
            raise ConfigError(
                source,
                "cluster.reward_devices",
                f"between 1 and cluster.devices - 1 = {c.devices - 1} (a GenRM needs devices, "
                "and so does rollout)",
                f"int {c.reward_devices}",
            )
        return self
