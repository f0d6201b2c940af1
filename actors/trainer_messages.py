"""The messages of the training role: what the driver asks the trainer (a GRPO step on a
scored batch, or its counts in a simulation), what the controller asks it around shifts (offload, reload) and
gradient helpers (inference replicas with nothing to run joining the step in flight), and the
trainer state it publishes for the planner.

Names carry "Trainer" where a bare verb (Offload, Reload) could collide with another role's
message: tags are class names, one union for the whole job.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pivot.actors.messages import RLMessage
from pivot.training import RolloutSample, TrainingSettings, TrainStats

TrainerStateName = Literal["idle", "training", "offloaded"]


class TrainBatch(RLMessage, kw_only=True):
    """Driver -> trainer: run one GRPO step on these scored completions. ``step``: the
    driver's step number, for logs and the reply. ``version``: the policy version the step
    trains from; a trainer at another refuses it (None: any). ``max_staleness``: the bound of
    ``pivot.grpo``'s staleness rule, in policy versions (the Driver's ``staleness``): tokens
    sampled by a policy older than the trainer's version minus it are masked out of the loss
    and counted in ``TrainStats.stale_tokens`` (None: no bound)."""

    samples: list[RolloutSample]
    step: int = -1
    # after the step, save a checkpoint into this folder (DeepSpeedTrainer.save); "": none
    checkpoint: str = ""
    version: int | None = None
    max_staleness: int | None = None


class TrainerRestart(msgspec.Struct, frozen=True, kw_only=True):
    """How a trainer group that died came back: from ``source`` (``checkpoint``, the last
    complete one, named by ``checkpoint``; ``gps``, the GPS copy of the weights with a fresh
    optimizer; ``start``, the job's own starting point), at policy ``version``. ``exact``:
    training goes on as if nothing had happened (weights, optimizer and rng restored)."""

    source: str
    version: int
    checkpoint: str | None
    exact: bool


class SimTrainBatch(RLMessage, kw_only=True):
    """Driver -> simulated trainer: a step over this many sequences and tokens (a simulated
    policy needs only the counts)."""

    step: int
    sequences: int
    tokens: int


class Trained(RLMessage, kw_only=True):
    """The step's statistics; ``stats.version`` is the new policy version, already
    published to GPS when ``gps_version`` is set (None: the trainer has no store)."""

    step: int
    stats: TrainStats
    gps_version: int | None = None
    gps_write_s: float = 0.0
    checkpoint_s: float = 0.0  # the checkpoint the batch asked for, written before the reply
    # the trainer group died since its last reply (during this step, or before it) and came
    # back so; the step was trained by the group that came back
    restart: TrainerRestart | None = None


class OffloadTrainer(RLMessage, kw_only=True):
    """Controller -> trainer: move optimizer state, gradients and parameters off the devices
    (the trainer pool lends them to inference). Idempotent."""


class ReloadTrainer(RLMessage, kw_only=True):
    """Controller -> trainer: take the state back before training. Idempotent; a TrainBatch
    that arrives while offloaded reloads first."""


class QueryTrainer(RLMessage, kw_only=True):
    """Ask for the trainer's status. ``fingerprints``: also a digest of each rank's
    parameters (a collective over the group: a few ms for the tiny policy)."""

    fingerprints: bool = False


class TrainerStatus(RLMessage, kw_only=True):
    """The reply to QueryTrainer, OffloadTrainer and ReloadTrainer.

    ``fingerprints``: per rank, the sha256 of its exported parameters (names sorted, raw
    bytes), empty unless asked for; every rank holds the same policy when they are equal.
    ``seconds``: what the request itself took (the offload or reload, for those).
    """

    name: str
    state: TrainerStateName
    version: int
    world_size: int
    zero_stage: int
    steps: int
    store: str | None
    fingerprints: list[str] = []
    seconds: float = 0.0
    # whether it holds its pool: a batch that found the pool lent makes the state
    # "training" while the pool still serves inference, until the Controller reclaims it
    holds_pool: bool = True
    # whether its backend can take gradient helpers (HelpTrainer); one that cannot is never
    # sent any
    takes_helpers: bool = False
    # how long the last reclaimed pool and its batch missed each other: > 0 the pool was back
    # that long before the batch came (idle), < 0 the batch waited that long for it; one more
    # in ``pool_slacks`` each time a reload meets a batch
    pool_slack_s: float = 0.0
    pool_slacks: int = 0


class GradientHelper(msgspec.Struct, frozen=True):
    """An inference replica offered to the step in flight: its id, role and devices."""

    replica: str
    role: str
    devices: list[int]


class HelpTrainer(RLMessage, kw_only=True):
    """Controller -> trainer: these replicas hold no sequence (or, packed tails, hold ones the
    Controller moves elsewhere once the step takes them) and none can reach them before the
    step in flight ends; compute gradients for it. Reply: ``Helping``."""

    helpers: list[GradientHelper]


class Helping(RLMessage, kw_only=True):
    """The replicas the step took (the rest: no step runs, or it ends no sooner with them).
    ``version``: the policy version the step will publish."""

    replicas: list[str]
    version: int


class HelpEnded(RLMessage, kw_only=True):
    """Trainer -> Controller, before the step's reply: the step these replicas helped has
    ended; route to them again."""

    replicas: list[str]


class WireTensor(msgspec.Struct, array_like=True):
    """A tensor on the wire: dtype name (``float32``), shape and raw bytes
    (``pivot.actors.tensor_wire`` converts)."""

    dtype: str
    shape: list[int]
    data: bytes


class WireBatch(msgspec.Struct, array_like=True):
    """A ``pivot.grpo.GRPOBatch`` on the wire: its tensor fields by name, and its pad id."""

    tensors: dict[str, WireTensor]
    pad_id: int


class ComputeGradients(RLMessage, kw_only=True):
    """Trainer -> a gradient helper's agent: the summed gradient of the GRPO loss over
    ``batches`` (micro-batches of the step in flight) for the policy ``version`` in the GPS
    store ``store``, the policy's architecture read from the Hugging Face folder ``policy``;
    each micro-batch's token losses divided by ``denominator``, as the trainer's ranks divide
    theirs. Reply: ``HelperGradients``."""

    version: int
    store: str
    policy: str
    batches: list[WireBatch]
    denominator: float
    settings: TrainingSettings


class HelperGradients(RLMessage, kw_only=True):
    """The gradient, by parameter name (those the policy trains), and the loss sums
    (``pivot.grpo.LossSums``, in field order) of the micro-batches a ``ComputeGradients``
    named. ``stale``: GPS published a newer version before the helper read it (the step it
    was for has ended: a helper that came too late), so it computed nothing."""

    grads: dict[str, WireTensor]
    sums: list[float]
    stale: bool = False


class TrainerState(RLMessage, kw_only=True):
    """Published on topic ``trainer`` whenever the state changes (lossy, for monitors and
    the planner: the trainer pool may lend devices only while it is not training)."""

    name: str
    state: TrainerStateName
    version: int
    last_step_s: float = 0.0
    # the step that just trained, leaving state training (start, end on the trainer's
    # clock): a real job's time account of the trainer's devices
    span: tuple[float, float] | None = None
