"""The physical bounds of an RL run: how soon its measured steps could have ended at best, from
the batches the run actually drew, the roles' cost models and the trainer's model. A run's
fraction of a bound is the bound's time over its own time for the same steps (1.0: at the
bound); the time account (``pivot.account``) says where the rest went.

**Work-conserving bound.** Every device works all the time, each role at its most efficient
operating point, and nothing costs a shift: the measured steps' device-seconds of rollout,
reward and training work, summed, over the cluster's devices. A role's efficient point is the
batch ``b <= max_running`` whose KV footprint ``b * c`` fits the replica's KV capacity and
that maximises tokens/s per device, ``b / ITL(b, b * c) / devices_per_replica``, where ``c``
is the step's token-weighted mean context (prompt + tokens so far, as the simulated engine
counts them). Decoding a step's tokens at that batch costs ``devices * sum over tokens of
ITL(b, b * c) / b`` (the cost model is linear in tokens, so each token may carry its own
context); every prompt is prefilled once at the prefill rate. Training runs on the fewest
devices that hold its state (``state_bytes_per_param * params`` in device memory): its fixed
step cost is paid by that many devices, its per-token cost and its GPS write do not depend on
how many.

**Critical-path bound.** Sequence ``i`` of batch ``k`` cannot be scored before its response
and then its judgment are each decoded alone (batch 1, the lowest ITL, with its own context,
after its prompt's prefill): ``C_k = max_i (response_i + judgment_i)``. (This is at most the
longest response plus the longest judgment, and still a bound: a judgment needs its whole
response.) Training on the whole cluster, ``T_k``, follows, one step at a time, in order; and
with staleness ``s`` batch ``k`` is not submitted before train step ``k - s - 1`` ended, nor
before batch ``k - 1`` (the Driver's rule, ``pivot.actors.driver``)::

    start_k      >= max(start_{k-1}, train_end_{k-s-1})      (start_0 >= t0)
    scored_k     >= start_k + C_k
    train_end_k  >= max(scored_k, train_end_{k-1}) + T_k

taken with equality; the bound is ``train_end_last - t0``. Steps before ``first_step`` (a
warm-up the measurement leaves out) enter with their actual start and end: the bound is then
how soon the measured steps could have ended given how the warm-up left the run. The
work-conserving bound counts, besides the measured steps' work, the training of every warm-up
step whose predecessor ended inside the window: train steps run in order, so that training
cannot have begun before the window opened, and any run must still do it there. (With staleness
``s`` the window opens when batch ``first_step`` is admitted, up to ``s`` train steps before the
warm-up's last one ends; leaving their training out would credit every deployment with idle
devices it never had.)

Gradient helpers (``pivot.engines.helped_step``) train on the trainer's pool and at most every
other device, at the same per-device rate, and add a reduce: a helped step is no shorter than
``T_k`` on the whole cluster and does no less work, so both bounds stay lower bounds.

**Combined.** The run is no faster than the larger of the two.

    inference_costs(workload) -> {role: InferenceCost}
    efficient_point(cost, context) -> OperatingPoint
    alone_s(cost, prompt, tokens) -> seconds
    step_bound(lengths, inference, trainer, devices) -> StepBound
    run_bound(steps, devices, staleness, window, first_step, history) -> Bound
    workload_bound(workload, lengths, devices, staleness, window, ...) -> Bound
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from pivot.cluster import INFERENCE_ROLES, Role
from pivot.engines.sim_engine import SimTrainer
from pivot.planning.cost import CostModel
from pivot.workload import StepLengths, Workload

#: "At or near the efficient batch": the batches whose tokens/s per device are within this
#: fraction of the efficient point's (the time account's busy vs under-filled threshold)
NEAR_EFFICIENT = 0.9


class InferenceCost(NamedTuple):
    """What one inference role's replica can do: its decode cost and its limits."""

    cost: CostModel
    devices: int  # per replica
    max_running: int
    kv_capacity_tokens: int
    prefill_tokens_per_s: float  # per replica


class OperatingPoint(NamedTuple):
    batch: int  # the efficient batch
    tokens_per_s: float  # per device, there
    near_batch: int  # the smallest batch within NEAR_EFFICIENT of it


def inference_costs(workload: Workload) -> dict[Role, InferenceCost]:
    return {
        role: InferenceCost(
            cost=workload.cost_model(role),
            devices=workload.model(role).layout.size,
            max_running=workload.model(role).max_running,
            kv_capacity_tokens=workload.kv_capacity_tokens(role),
            prefill_tokens_per_s=workload.prefill_tokens_per_s(role),
        )
        for role in INFERENCE_ROLES
    }


def efficient_point(cost: InferenceCost, context: float) -> OperatingPoint:
    """The batch of sequences of mean context ``context`` that maximises tokens/s per device
    within ``max_running`` and the KV capacity (ties: the smaller batch)."""
    fits = int(cost.kv_capacity_tokens // max(context, 1.0))
    batches = np.arange(1, max(1, min(cost.max_running, fits)) + 1, dtype=np.float64)
    rates = batches / cost.cost.itl(batches, batches * context) / cost.devices
    best = int(np.argmax(rates))
    near = int(np.argmax(rates >= NEAR_EFFICIENT * rates[best]))
    return OperatingPoint(best + 1, float(rates[best]), near + 1)


def _decode_alone_s(cost: CostModel, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Seconds to decode ``tokens`` tokens of each sequence alone from ``context`` tokens:
    iteration j runs at ITL(1, context + j)."""
    per_step = max(cost.b, cost.c) + cost.d
    return tokens * per_step + cost.a * (tokens * context + tokens * (tokens - 1) / 2.0)


def alone_s(cost: InferenceCost, prompt: Any, tokens: Any) -> Any:
    """Seconds for a sequence of ``prompt`` tokens to be prefilled and decode ``tokens``
    tokens alone (vectorised: numbers or numpy arrays)."""
    return prompt / cost.prefill_tokens_per_s + _decode_alone_s(cost.cost, prompt, tokens)


def _mean_context(prompt: np.ndarray, tokens: np.ndarray) -> float:
    """Token-weighted mean context over the decode of every sequence (prompt + tokens so far)."""
    total = float(tokens.sum())
    if total <= 0:
        return float(prompt.mean()) if prompt.size else 1.0
    return float((tokens * prompt + tokens * (tokens - 1) / 2.0).sum()) / total


def role_work_s(cost: InferenceCost, prompt: np.ndarray, tokens: np.ndarray) -> float:
    """Device-seconds to prefill ``prompt`` and decode ``tokens`` of every sequence at the
    role's efficient point."""
    context = _mean_context(prompt, tokens)
    point = efficient_point(cost, context)
    b = point.batch
    per_token = cost.cost.itl_one(b, b * context) / b  # mean over the tokens: ITL is linear
    decode = float(tokens.sum()) * per_token
    prefill = float(prompt.sum()) / cost.prefill_tokens_per_s
    return cost.devices * (decode + prefill)


def fewest_trainer_devices(trainer: SimTrainer) -> int:
    """The fewest devices whose memory holds the trainer's state (weights, gradients, optimizer)."""
    state = trainer.params_b * 1e9 * trainer.costs.state_bytes_per_param
    return max(1, math.ceil(state / (trainer.hardware.memory_gb * 1e9)))


def _trainer_on(trainer: SimTrainer, devices: int) -> SimTrainer:
    return SimTrainer(
        params_b=trainer.params_b,
        devices=devices,
        hardware=trainer.hardware,
        costs=trainer.costs,
        shift=trainer.shift,
    )


def train_time_s(trainer: SimTrainer, tokens: int) -> float:
    """One step on the trainer's devices, its GPS write included (what the simulated trainer
    sleeps)."""
    return trainer.step_time_s(tokens) + trainer.write_s()


class StepBound(msgspec.Struct, frozen=True, kw_only=True):
    """One step's share of the bounds."""

    step: int
    work_device_s: dict[str, float]  # role -> device-seconds at its efficient point
    chain_s: float  # C_k: the longest response + judgment, each decoded alone
    train_s: float  # T_k: training on the whole cluster

    @property
    def work_s(self) -> float:
        return sum(self.work_device_s.values())


def step_bound(
    lengths: StepLengths,
    inference: Mapping[Role, InferenceCost],
    trainer: SimTrainer,
    devices: int,
) -> StepBound:
    """The work and critical-path terms of one step's batch on ``devices`` devices."""
    prompt = lengths.sequence_prompt_tokens.astype(np.float64)
    response = lengths.response_tokens.astype(np.float64)
    genrm = lengths.genrm_prompt_tokens.astype(np.float64)
    judgment = lengths.judgment_tokens.astype(np.float64)
    rollout, reward = inference[Role.ROLLOUT], inference[Role.REWARD]
    tokens = lengths.train_tokens
    fewest = _trainer_on(trainer, fewest_trainer_devices(trainer))
    work = {
        Role.ROLLOUT.value: role_work_s(rollout, prompt, response),
        Role.REWARD.value: role_work_s(reward, genrm, judgment),
        Role.TRAINING.value: fewest.devices * train_time_s(fewest, tokens),
    }
    chain = alone_s(rollout, prompt, response) + alone_s(reward, genrm, judgment)
    return StepBound(
        step=lengths.step,
        work_device_s=work,
        chain_s=float(chain.max()) if chain.size else 0.0,
        train_s=train_time_s(_trainer_on(trainer, devices), tokens),
    )


class Bound(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds of a run's measured steps against the time they took."""

    steps: int  # measured steps
    devices: int
    work_s: float  # the work-conserving bound
    critical_path_s: float  # the critical-path bound
    actual_s: float  # the run's time for the same steps
    work_device_s: dict[str, float]  # role -> device-seconds of work at the efficient points
    # device-seconds of warm-up training the window must hold (the module docstring)
    carried_device_s: float = 0.0
    # the critical-path terms, means over the measured steps: C_k and T_k
    chain_s: float = 0.0
    train_s: float = 0.0

    @property
    def combined_s(self) -> float:
        return max(self.work_s, self.critical_path_s)

    def fractions(self) -> dict[str, float]:
        """Bound time / actual time (0-1: 1 is at the bound)."""
        actual = max(self.actual_s, 1e-12)
        return {
            "work": self.work_s / actual,
            "critical_path": self.critical_path_s / actual,
            "combined": self.combined_s / actual,
        }


def critical_path_end(
    chain_s: Sequence[float],
    train_s: Sequence[float],
    staleness: int,
    *,
    t0: float = 0.0,
    first_step: int = 0,
    history: Sequence[tuple[float, float]] = (),
) -> float:
    """The earliest time the last step can have trained (the recursion in the module
    docstring). ``chain_s[k]``, ``train_s[k]``: step k's C_k and T_k; ``history``: the actual
    (start, end) of the steps before ``first_step``; the first step starts at ``t0``."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if len(history) != first_step:
        raise ValueError(f"{first_step} steps before the first measured one need their times")
    if len(chain_s) != len(train_s):
        raise ValueError("chain_s and train_s must name the same steps")
    starts = [s for s, _ in history]
    ends = [e for _, e in history]
    for k in range(first_step, len(chain_s)):
        start = starts[k - 1] if k else t0
        if k - staleness - 1 >= 0:
            start = max(start, ends[k - staleness - 1])
        scored = start + chain_s[k]
        ends.append(max(scored, ends[k - 1] if k else t0) + train_s[k])
        starts.append(start)
    return ends[-1] if ends else t0


def run_bound(
    steps: Sequence[StepBound],
    *,
    devices: int,
    staleness: int,
    window: tuple[float, float],
    first_step: int = 0,
    history: Sequence[tuple[float, float]] = (),
) -> Bound:
    """The bounds of ``steps[first_step:]`` against the run's ``window`` (start, end) for
    them. ``steps`` are every step of the run in order, ``history`` the actual (start, end) of
    those before ``first_step``."""
    t0, t1 = window
    measured = steps[first_step:]
    end = critical_path_end(
        [s.chain_s for s in steps],
        [s.train_s for s in steps],
        staleness,
        t0=t0,
        first_step=first_step,
        history=history,
    )
    work: dict[str, float] = {}
    for s in measured:
        for role, seconds in s.work_device_s.items():
            work[role] = work.get(role, 0.0) + seconds
    carried = sum(
        steps[j].work_device_s[Role.TRAINING.value]
        for j in range(1, first_step)
        if history[j - 1][1] >= t0
    )
    return Bound(
        steps=len(measured),
        devices=devices,
        work_s=(sum(work.values()) + carried) / devices,
        critical_path_s=end - t0,
        actual_s=t1 - t0,
        work_device_s=work,
        carried_device_s=carried,
        chain_s=float(np.mean([s.chain_s for s in measured])) if measured else 0.0,
        train_s=float(np.mean([s.train_s for s in measured])) if measured else 0.0,
    )


def workload_bound(
    workload: Workload,
    lengths: Sequence[StepLengths],
    *,
    devices: int,
    staleness: int,
    window: tuple[float, float],
    first_step: int = 0,
    history: Sequence[tuple[float, float]] = (),
) -> Bound:
    """``run_bound`` of a simulated workload's drawn batches (every step's, in order)."""
    inference = inference_costs(workload)
    trainer = workload.make_trainer(devices)
    steps = [step_bound(s, inference, trainer, devices) for s in lengths]
    return run_bound(
        steps,
        devices=devices,
        staleness=staleness,
        window=window,
        first_step=first_step,
        history=history,
    )


def operating_points(
    workload: Workload, lengths: Sequence[StepLengths]
) -> dict[str, OperatingPoint]:
    """Each inference role's efficient point over ``lengths`` (every sequence's context)."""
    inference = inference_costs(workload)
    out = {}
    for role, prompt, tokens in (
        (Role.ROLLOUT, "sequence_prompt_tokens", "response_tokens"),
        (Role.REWARD, "genrm_prompt_tokens", "judgment_tokens"),
    ):
        p = np.concatenate([getattr(s, prompt) for s in lengths]).astype(np.float64)
        t = np.concatenate([getattr(s, tokens) for s in lengths]).astype(np.float64)
        out[role.value] = efficient_point(inference[role], _mean_context(p, t))
    return out
