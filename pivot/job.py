"""The job's configuration: one nested ConfigStruct per component, read from a TOML file.

Every field has the default of the tiny CPU job (``configs/tiny.toml``), so a config file
only states what it changes. Constraints are part of the types, so a bad value is reported
with the file, the key, what was expected and what was found; ``JobConfig.validate`` checks
the rules that span sections.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pivot.accelerator import (
    MEM_FRACTION_STATIC,
    TRAINER_GPU_FRACTION,
    Accelerator,
    DType,
    GpuLayout,
    PlacementError,
    place,
)
from pivot.cluster import Role
from pivot.config import (
    ConfigError,
    ConfigStruct,
    Count,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seconds,
)
from pivot.deployment import Deployment, DeploymentKind, Split, plan_deployment
from pivot.planning.planner import PlannerSettings
from pivot.training import TrainingSettings


class ClusterSection(ConfigStruct):
    """The devices: one role-agent process per device.

    ``accelerator``: ``cpu``, a device is a process with torch pinned to its threads; or
    ``cuda``, device N is GPU N (``cuda:N``; ``devices`` at most ``torch.cuda.device_count()``),
    where the torch engine serves one replica per GPU, each trainer rank trains on its GPU over
    NCCL, and SGLang serves on its GPU (``pivot.accelerator``). ``gpus`` (``cuda`` only): the
    GPU of each job device instead, which several may share (``[0, 0, 0]``: all on GPU 0);
    the trainer then has one rank per distinct GPU of its devices, and
    ``trainer_gpu_fraction`` of ``model.mem_fraction_static`` on a trainer rank's GPU is the
    trainer's, not SGLang's.

    The last ``trainer_devices`` form the trainer pool (one DeepSpeed rank each, one per GPU
    on ``cuda``); the others are the shared pool of rollout and reward replicas.
    """

    accelerator: Accelerator = "cpu"
    devices: Count(4096) = 4
    gpus: tuple[NonNegativeInt, ...] = ()
    threads_per_device: PositiveInt = 1
    trainer_devices: PositiveInt = 2
    trainer_gpu_fraction: Fraction = TRAINER_GPU_FRACTION
    # cpu: pin each device's processes (its agent, its trainer rank) to its own share of this
    # host's cores, with as many torch threads as it has cores (pivot.accelerator.device_cores)
    pin_cores: bool = False


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
    """Hugging Face checkpoint folders; a bare name is one of the models pivot ships.

    ``engine``: what serves rollout and GenRM replicas: ``torch``, pivot's own engine (CPU, or
    one GPU per replica with ``cluster.accelerator = "cuda"``), or ``sglang``, an in-process
    SGLang engine per replica on its GPU (the ``gpu`` extra, in a venv of its own: README,
    "GPU (SGLang)"). ``dtype``: the torch engine's weights and KV cache and the trainer's
    DeepSpeed precision: ``float32``, or ``bfloat16`` (``cluster.accelerator = "cuda"``
    only); SGLang serves in bfloat16 either way. ``mem_fraction_static``: SGLang's, for each
    GPU: the share its engines there (and a trainer rank's ``cluster.trainer_gpu_fraction``)
    take together, split evenly among them (``pivot.accelerator``).
    """

    policy: str = "tiny-policy"
    genrm: str = "tiny-genrm"
    max_running: Count(65_536) = 32
    engine: Literal["torch", "sglang"] = "torch"
    dtype: DType = "float32"
    mem_fraction_static: Fraction = MEM_FRACTION_STATIC


class RolloutSection(ConfigStruct):
    """``function``: the rollout function run for every prompt x sample (``pivot.rollout``),
    ``"package.module:name"`` or ``"path/to/file.py:name"`` (relative to the config file); empty:
    one response per prompt (``pivot.rollout.single_turn``). ``gateway``: serve the OpenAI
    gateway its ``ctx.openai_base_url`` points at (127.0.0.1, an ephemeral port). ``staleness``:
    how many batches rollout may run ahead of training (asynchronous RL: batch k is rolled
    out once step k - staleness - 1 trained, so with 1 the next batch decodes while this one
    trains; the trainer masks tokens sampled by a policy more than ``staleness`` versions old;
    0: synchronous, on-policy). Sampling keys are each call's defaults."""

    function: str = ""
    gateway: bool = False
    staleness: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0
    prompts_per_step: Count(1_000_000) = 16
    samples_per_prompt: Count(4096) = 4
    max_new_tokens: Count(1 << 20) = 32
    temperature: PositiveFloat = 1.0
    top_p: Fraction = 1.0


class DataSection(ConfigStruct):
    """The prompts (``pivot.data``). ``train``: a ``.jsonl`` or ``.parquet`` file, relative to
    the config file; empty: the shipped arithmetic task, made from the seed. ``prompt_key``:
    the field holding the prompt, a string or a list of chat messages (encoded with the
    policy's chat template); ``reference_key``: the field holding the reference answer (empty:
    none); every other field reaches the reward as metadata. ``shuffle``: a seeded
    permutation per epoch. ``epochs``: stop after this many passes over the data (the job runs
    the whole steps that fit, at most ``steps``); 0: cycle for ``steps`` steps. ``eval``: a
    file of the same form, generated (at ``eval_temperature``, 0: greedy) and scored after
    every ``eval_every``-th step (0: only after the last), never trained on."""

    train: str = ""
    prompt_key: str = "prompt"
    reference_key: str = ""
    shuffle: bool = True
    epochs: NonNegativeInt = 0
    eval: str = ""
    eval_every: NonNegativeInt = 0
    eval_temperature: NonNegativeFloat = 0.0


class RewardSection(ConfigStruct):
    """How a response is scored (``pivot.rewards``).

    * ``genrm``: the GenRM judges it. Its prompt comes from ``template`` (a jinja2 file;
      empty: the task's own prompt, or ``pivot.prompts.DEFAULT_TEMPLATE`` for a data file),
      as the user turn of the GenRM's chat template when its tokenizer has one, after
      ``system_prompt``; ``verdict`` names the parser of its judgment (empty: ``pivot.task:
      verdict``, which reads a final ': correct' or ': wrong').
    * ``function``: ``function`` names a Python function, ``"package.module:name"`` or
      ``"path/to/file.py:name"`` (relative to the config file), sync or async, given a
      ``pivot.rewards.RewardInput``, returning a float or a dict with a ``score``; each call
      has ``timeout_s``.
    * ``exact``: the checker's verdict (1 or 0) is the reward.

    ``checker`` (optional) names a function of a ``RewardInput`` returning a bool: the step
    reports accuracy and the GenRM's agreement with it. The shipped task has its exact checker.
    A reward that fails (raises, times out, gives no verdict or a non-number) is counted and
    its sample left out of training.
    """

    kind: Literal["genrm", "function", "exact"] = "genrm"
    function: str = ""
    timeout_s: Seconds = 30.0
    checker: str = ""
    template: str = ""
    system_prompt: str = ""
    verdict: str = ""
    max_new_tokens: PositiveInt = 24


class CheckpointSection(ConfigStruct):
    """``every``: a checkpoint after every N-th step (0: only the last); the last step always
    gets one. ``keep``: the newest complete checkpoints kept (0: all). Each is the policy as a
    Hugging Face folder and the trainer's state (``pivot.actors.checkpoints``);
    ``pivot run --resume RUN_DIR`` continues after the last complete one."""

    every: NonNegativeInt = 0
    keep: NonNegativeInt = 2


class LogSection(ConfigStruct):
    """``samples``: write every scored sample (texts, token ids, the GenRM's prompt ids and
    judgment, score or failure) to samples.jsonl in the run folder. ``tensorboard``: write
    the steps' scores, training statistics and throughput, and the devices and throughput
    of each role over time, as TensorBoard event files in ``RUN_DIR/tensorboard``."""

    samples: bool = False
    tensorboard: bool = True


class ControlSection(ConfigStruct):
    """The Controller's pace. The paper's constants (60 s horizon, 10 s cooldown) are for
    steps of minutes; the tiny job's steps take seconds, so its defaults are scaled down.
    ``stall_timeout_s``: a step during which no response and no score arrives for this long
    stops the job with an error naming the stage it waits on (a lost sequence would
    otherwise hang it). ``trainer_restarts``: how often the trainer group (all its ranks,
    after one died) is restarted within ``trainer_restart_window_s``; the next death stops
    the job (0: the first does)."""

    interval_s: Seconds = 0.1
    command_timeout_s: Seconds = 60.0
    stall_timeout_s: Seconds = 300.0
    trainer_restarts: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2
    trainer_restart_window_s: Seconds = 600.0
    planner: PlannerSettings = PlannerSettings(
        horizon_s=4.0, cooldown_s=0.3, immunity_s=0.3, migrate_time_init_s=0.3
    )


class AttachSection(ConfigStruct):
    """``tcp``: an address, ``tcp://HOST:PORT`` (port 0: any free one), on which the job's
    Driver also takes requests, so that ``pivot.attach`` reaches the job from another host.
    It needs the job's shared secret (``PIVOT_SECRET_FILE``): requests are sealed with it. On
    this host the ipc address in ``RUN/job.json`` always works."""

    tcp: str = ""


class JobConfig(ConfigStruct):
    """The whole job."""

    seed: NonNegativeInt = 0
    steps: Count(10_000_000) = 20
    cluster: ClusterSection = ClusterSection()
    deployment: DeploymentSection = DeploymentSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    rollout: RolloutSection = RolloutSection()
    reward: RewardSection = RewardSection()
    training: TrainingSettings = TrainingSettings()
    control: ControlSection = ControlSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()
    attach: AttachSection = AttachSection()

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

    def layout(self) -> GpuLayout:
        """Each job device's GPU, the trainer's ranks and each SGLang engine's share of its
        GPU (``pivot.accelerator.place``); raises ``PlacementError``."""
        c, deployment = self.cluster, self.plan()
        engines = (
            {d: len(deployment.engine_roles(d)) for d in deployment.agent_devices}
            if self.model.engine == "sglang"
            else None
        )
        return place(
            c.accelerator,
            c.devices,
            trainer_devices=deployment.trainer_devices,
            engines=engines,
            gpus=c.gpus,
            mem_fraction_static=self.model.mem_fraction_static,
            trainer_gpu_fraction=c.trainer_gpu_fraction,
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
        if self.model.dtype == "bfloat16" and c.accelerator != "cuda":
            raise ConfigError(
                source,
                "model.dtype",
                "'float32' on CPU (bfloat16 needs cluster.accelerator = 'cuda')",
                f"{self.model.dtype!r}",
            )
        if c.pin_cores and c.accelerator != "cpu":
            raise ConfigError(
                source,
                "cluster.pin_cores",
                "false on CUDA (a device is a GPU there; pinning shares CPU cores)",
                "true",
            )
        self._check_reward(source)
        judged = self.reward.kind == "genrm"
        most = self.shared_devices - (1 if judged and d.kind is DeploymentKind.DISAGGREGATED else 0)
        pools = d.kind in (DeploymentKind.PIVOT, DeploymentKind.DISAGGREGATED)
        if pools and d.rollout_devices > most:
            why = "leaving one for the GenRM" if most < self.shared_devices else ""
            raise ConfigError(
                source,
                "deployment.rollout_devices",
                f"at most {most} (the shared devices: cluster.devices - cluster.trainer_devices"
                f"{', ' + why if why else ''})",
                f"int {d.rollout_devices}",
            )
        if c.accelerator == "cuda" or c.gpus:  # once the deployment can be planned
            try:
                self.layout()
            except PlacementError as exc:
                raise ConfigError(source, exc.key, exc.expected, exc.found) from None
        return self._check_temperature(source)

    def _check_reward(self, source: str) -> None:
        r = self.reward
        if r.kind == "function" and not r.function:
            raise ConfigError(
                source, "reward.function", "a function name with kind 'function'", "nothing"
            )
        if r.function and r.kind != "function":
            raise ConfigError(
                source,
                "reward.function",
                "no value unless reward.kind = 'function'",
                f"kind {r.kind!r}",
            )
        genrm_only = ("template", "system_prompt", "verdict")
        for key in genrm_only:
            if getattr(r, key) and r.kind != "genrm":
                raise ConfigError(
                    source,
                    f"reward.{key}",
                    "no value unless reward.kind = 'genrm'",
                    f"kind {r.kind!r}",
                )
        if r.kind == "exact" and self.data.train and not r.checker:
            raise ConfigError(
                source,
                "reward.checker",
                "a checker: kind 'exact' scores with it",
                "nothing (data.train has no built-in checker)",
            )
        if self.data.eval_every and not self.data.eval:
            raise ConfigError(
                source, "data.eval", "an evaluation file, with data.eval_every", "nothing"
            )

    def _check_temperature(self, source: str) -> JobConfig:
        if self.training.temperature != self.rollout.temperature:
            raise ConfigError(
                source,
                "training.temperature",
                f"the rollout's sampling temperature, {self.rollout.temperature}",
                f"float {self.training.temperature}",
            )
        return self
