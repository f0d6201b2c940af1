"""What a training step takes and returns, without torch: the trainer's settings (part of a
job's config), the scored samples it trains on and the statistics of a step. Messages and
configs use these, so a process that never trains (a simulation, the CLI's config checks)
does not import torch; ``pivot.grpo`` holds the math.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pivot.config import (
    ConfigStruct,
    NonNegativeFloat,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
)


class TrainingSettings(ConfigStruct):
    """How the trainer updates the policy.

    ``lr``: the paper's 1e-6 is for 7B models; the tiny CPU policy (~0.8M parameters) needs
    a rate a hundred times larger to move within the ~20 steps of the tiny job. Measured on
    an SFT-made tiny policy (16 prompts x 4 samples, exact-checker reward, same prompts and
    seeds for every rate): 1e-5 and 3e-5 leave the training reward flat; 1e-4 lifts it
    slowly (+0.035 to +0.06 over 1e-5 in steps 10-30, two prompt seeds); 2e-4 and 3e-4 make
    the policy worse, 1e-3 collapses it (reward 0 by step 3). Adam moves every weight by
    ~lr per step whatever the signal, and this small batch's gradient is mostly noise. ``warmup_steps``: the learning rate
    ramps up linearly over the first ``warmup_steps`` steps, the last of which runs at
    ``lr`` (0: every step at ``lr``). ``micro_batch_size``: sequences per forward/backward on one rank;
    each rank runs as many micro-batches as its share of the batch needs.
    ``temperature``: the rollout's sampling temperature: behaviour logprobs were taken under
    softmax(logits / T), so the trainer's are too. ``zero_stage`` 3 uses DeepSpeed's
    FusedAdam (a one-time JIT build of about 45 s on CPU), because DeepSpeed offloads
    optimizer states at stage 3 only for FusedAdam; stages 1 and 2 use torch's AdamW.
    ``zero3_persistence_threshold``: parameters smaller than this stay whole on every rank
    at stage 3 (DeepSpeed's default is 1e5 elements, which would leave a tiny model
    unpartitioned).
    """

    lr: PositiveFloat = 1e-4
    warmup_steps: NonNegativeInt = 0
    weight_decay: NonNegativeFloat = 0.1
    adam_betas: tuple[OpenUnitInterval, OpenUnitInterval] = (0.9, 0.999)
    adam_eps: PositiveFloat = 1e-8
    grad_clip: PositiveFloat = 1.0
    clip_low: OpenUnitInterval = 0.2
    clip_high: PositiveFloat = 0.28
    dual_clip: Annotated[float, msgspec.Meta(gt=1.0)] | None = 10.0
    kl_coef: NonNegativeFloat = 0.0
    advantage_eps: PositiveFloat = 1e-6
    temperature: PositiveFloat = 1.0
    micro_batch_size: PositiveInt = 32
    zero_stage: Literal[1, 2, 3] = 2
    zero3_persistence_threshold: NonNegativeInt = 0
    seed: NonNegativeInt = 0


class RolloutSample(msgspec.Struct, frozen=True, kw_only=True):
    """One scored completion (or multi-turn trajectory) as the trainer needs it.

    ``logprobs``: the behaviour logprob of each response token, as the rollout engine
    sampled it. ``group``: the prompt group (the n samples of one prompt share it);
    advantages are normalised within a group. ``loss_mask``: per response token, 1 where
    the policy sampled it and the loss trains on it, 0 for a tool's or the environment's
    token (its logprob is ignored); empty: every response token trains. ``versions``: per
    response token, the policy version that sampled it (``pivot.trajectory.NO_VERSION``
    where masked), for the staleness rule of ``pivot.grpo``; empty: all of them sampled by
    the policy the step trains from.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    group: int
    loss_mask: list[int] = []
    versions: list[int] = []


class TrainStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one training step did.

    ``loss``: the token-mean GRPO loss of the batch before the update. ``grad_norm``: the
    global gradient norm before clipping. ``clip_fraction``: share of response tokens whose
    ratio was clipped (either side, dual clip included). ``ratio_mean``: mean new/behaviour
    probability ratio over response tokens. ``seconds``: wall time of the step as the
    backend measured it (0.0 without a clock). ``tokens`` counts the response tokens the
    loss trained on; ``masked_tokens`` those it skipped for their loss mask (tools', the
    environment's) and ``stale_tokens`` those it skipped for the staleness rule (sampled by a
    policy older than the bound allows: 0 in a healthy run, the Driver's admission keeps
    rollouts within it). ``helped_tokens``: of ``tokens``, those whose gradient gradient
    helpers computed (inference replicas with nothing to run, ``pivot.actors.gradient_help``).
    """

    version: int
    loss: float
    grad_norm: float
    lr: float
    sequences: int
    tokens: int
    reward_mean: float
    clip_fraction: float
    ratio_mean: float
    kl: float = 0.0
    seconds: float = 0.0
    stale_tokens: int = 0
    masked_tokens: int = 0
    helped_tokens: int = 0
