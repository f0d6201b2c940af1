"""Deployments: how a job's devices serve the roles, as a pure description.

A ``Deployment`` says, for one job, which devices train, which host a role agent, what every
device starts as (role, replica, the replica's devices), which devices the Controller manages
and how it decides (the planner, a time-sharing stage policy, or nothing), and the cluster spec
the Controller plans over. One builder (``pivot.actors.assembly``) turns it into running actors;
``pivot run``, ``pivot simulate``, ``pivot bench shift`` and the test kit's local cluster all
describe their jobs here and nowhere else.

Four kinds, all configurations of the same actors (DESIGN.md, "Baselines are configurations,
not separate code"):

* ``disaggregated``: fixed pools (rollout, reward, training devices); no Controller.
* ``rr-colocated``: one shared inference pool, time-multiplexed rollout -> reward by the
  Controller's stage policy, plus a training pool that only trains.
* ``colocated``: every device serves one stage at a time (rollout, reward, training); the
  trainer holds every device and lends them all between its steps.
* ``pivot``: the planner shifts the shared devices between rollout and reward and lends the
  trainer pool to inference while the trainer waits for a batch.

    Split(kind, gpus, rollout=0, reward=0, shared=0, training=0)     devices per pool
    parse_split(label) -> Split                           Split.label() read back
    table4_split(kind, gpus, sizes) / sweep_splits(kind, gpus, sizes)
    neighbours(split, grid)                               a sweep's next splits to try
    plan_deployment(split, sizes, *, devices_per_host, judged=True, pool_held=True)
        -> Deployment
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Literal

import msgspec

from pivot.cluster import INFERENCE_ROLES, ClusterSpec, Device, Pool, Role, RoleSpec, replica_id
from pivot.planning.plans import TRAINER_ID


class DeploymentKind(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    RR_COLOCATED = "rr-colocated"
    PIVOT = "pivot"


#: The static baselines pivot is compared against.
BASELINES = (DeploymentKind.COLOCATED, DeploymentKind.DISAGGREGATED, DeploymentKind.RR_COLOCATED)
#: The kinds' names, for command-line choices.
KIND_NAMES: tuple[str, ...] = tuple(k.value for k in DeploymentKind)


class DeploymentError(ValueError):
    """A split or layout that cannot be deployed; the message says why."""


def loop_staleness(kind: DeploymentKind | str, staleness: int) -> int:
    """The batches a deployment's RL loop lets rollout run ahead of training: the job's,
    but none for colocated, whose devices time-share every stage (its batches cannot
    overlap, as in the paper's launchers)."""
    return 0 if DeploymentKind(kind) is DeploymentKind.COLOCATED else staleness


class Split(msgspec.Struct, frozen=True, kw_only=True):
    """Devices per pool. ``disaggregated``: rollout, reward, training. ``rr-colocated``:
    shared (rollout -> reward) and training. ``colocated``: shared = every device, training on
    the same ones. ``pivot``: shared and the trainer pool ``training`` (lent to inference while
    the trainer waits); ``rollout`` of the shared devices start serving rollout (0: half)."""

    kind: DeploymentKind
    gpus: int
    rollout: int = 0
    reward: int = 0
    shared: int = 0
    training: int = 0

    def label(self) -> str:
        """The split as reports name it (``parse_split`` reads it back)."""
        if self.kind is DeploymentKind.DISAGGREGATED:
            return f"RO{self.rollout}/RM{self.reward}/TR{self.training}"
        if self.kind is DeploymentKind.RR_COLOCATED:
            return f"RO+RM{self.shared}/TR{self.training}"
        if self.kind is DeploymentKind.COLOCATED:
            return f"all{self.gpus}"
        return f"shared{self.shared}/pool{self.training}"


#: ``Split.label``'s forms, one per kind, with the pools they name
_LABELS: tuple[tuple[DeploymentKind, re.Pattern[str], tuple[str, ...]], ...] = (
    (
        DeploymentKind.DISAGGREGATED,
        re.compile(r"RO(\d+)/RM(\d+)/TR(\d+)"),
        ("rollout", "reward", "training"),
    ),
    (DeploymentKind.RR_COLOCATED, re.compile(r"RO\+RM(\d+)/TR(\d+)"), ("shared", "training")),
    (DeploymentKind.COLOCATED, re.compile(r"all(\d+)"), ("shared",)),
    (DeploymentKind.PIVOT, re.compile(r"shared(\d+)/pool(\d+)"), ("shared", "training")),
)


def parse_split(label: str) -> Split:
    """The split ``label`` names (``Split.label``'s forms: ``RO16/RM64/TR48``,
    ``RO+RM96/TR32``, ``all128``, ``shared32/pool96``); its devices are its pools' sum."""
    for kind, form, names in _LABELS:
        match = form.fullmatch(label.strip())
        if match is None:
            continue
        pools = dict(zip(names, (int(g) for g in match.groups()), strict=True))
        gpus = sum(pools.values())
        if gpus < 1:
            raise DeploymentError(f"split {label!r} has no devices")
        if kind is DeploymentKind.COLOCATED:
            return Split(kind=kind, gpus=gpus, shared=gpus, training=gpus)
        return Split(kind=kind, gpus=gpus, **pools)
    forms = ", ".join(("RO16/RM64/TR48", "RO+RM96/TR32", "all128", "shared32/pool96"))
    raise DeploymentError(f"split {label!r} is none of the forms {forms}")


def replica_unit(sizes: Mapping[Role, int]) -> int:
    """Pools are multiples of this many devices, so that every replica fits whole."""
    return max(sizes[r] for r in INFERENCE_ROLES)


def devices_per_host(gpus: int, unit: int) -> int:
    """Hosts of 8 devices (H20 nodes), fewer on a cluster smaller than a host."""
    host = 8 if gpus >= 8 else gpus
    host = max(host, unit)
    if gpus % host:
        raise DeploymentError(f"{gpus} devices do not make whole hosts of {host}")
    return host


def _round_to(value: float, unit: int, low: int) -> int:
    return max(low, int(round(value / unit)) * unit)


def table4_split(kind: DeploymentKind | str, gpus: int, sizes: Mapping[Role, int]) -> Split:
    """The seed's Table 4 (first group, 32 GPUs: disaggregated 8/8/16, rollout-reward
    colocated 16 shared + 16 training, colocated all 32, PivotRL a 16-device trainer pool),
    scaled to ``gpus`` and rounded to whole replicas of ``sizes`` (devices per replica)."""
    kind = DeploymentKind(kind)
    unit = replica_unit(sizes)
    if gpus % unit:
        raise DeploymentError(f"{gpus} devices are not a multiple of the replica size {unit}")
    if kind is DeploymentKind.COLOCATED:
        return Split(kind=kind, gpus=gpus, shared=gpus, training=gpus)
    pools = 3 if kind is DeploymentKind.DISAGGREGATED else 2  # a replica at least each
    if gpus < pools * unit:
        raise DeploymentError(f"{kind.value} needs at least {pools * unit} devices, got {gpus}")
    training = min(_round_to(gpus / 2, unit, unit), gpus - unit)
    if kind is DeploymentKind.DISAGGREGATED:
        training = min(training, gpus - 2 * unit)
        inference = gpus - training
        rollout = _round_to(inference / 2, unit, unit)
        rollout = min(rollout, inference - unit)
        return Split(
            kind=kind, gpus=gpus, rollout=rollout, reward=inference - rollout, training=training
        )
    return Split(kind=kind, gpus=gpus, shared=gpus - training, training=training)


def _axis(high: int, step: int, low: int | None = None) -> list[int]:
    """Pool sizes a sweep tries for a pool of at most ``high`` devices: ``low`` (default
    ``step``), the multiples of ``step`` up to ``high``, and ``high`` itself (the pool taking
    all the devices the others leave)."""
    return sorted({low or step, *range(step, high + 1, step), high})


def sweep_splits(
    kind: DeploymentKind | str, gpus: int, sizes: Mapping[Role, int], parts: int = 8
) -> list[Split]:
    """Static splits a sweep may try: pools in steps of ``gpus / parts`` devices (rounded up to
    whole replicas), each pool up to all the devices the others leave when they hold one
    replica (PivotRL's trainer pool up to the whole cluster). Colocated has only one."""
    kind = DeploymentKind(kind)
    unit = replica_unit(sizes)
    if kind is DeploymentKind.COLOCATED:
        return [table4_split(kind, gpus, sizes)]
    step = max(unit, -(-gpus // parts // unit) * unit)
    out: list[Split] = []
    if kind is DeploymentKind.DISAGGREGATED:
        for training in _axis(gpus - 2 * unit, step):
            # rollout down to one replica: the reward pool up to all the others leave
            for rollout in _axis(gpus - training - unit, step, unit):
                reward = gpus - training - rollout
                out.append(
                    Split(kind=kind, gpus=gpus, rollout=rollout, reward=reward, training=training)
                )
    else:
        # rr-colocated: the training pool (one inference replica at least); pivot: the trainer
        # pool it lends (its only static choice: it shifts the rest at run time), up to every
        # device
        top = gpus if kind is DeploymentKind.PIVOT else gpus - unit
        for training in _axis(top, step):
            out.append(Split(kind=kind, gpus=gpus, shared=gpus - training, training=training))
    return out


def pools(split: Split) -> tuple[int, ...]:
    """The devices of each pool a sweep moves devices between (disaggregated: rollout, reward,
    training; the others: shared, training)."""
    if split.kind is DeploymentKind.DISAGGREGATED:
        return (split.rollout, split.reward, split.training)
    return (split.shared, split.training)


def neighbours(split: Split, grid: Sequence[Split]) -> list[Split]:
    """The splits of ``grid`` one move from ``split``: for each ordered pair of pools (giver,
    taker), the grid split that moves the fewest devices from the giver to the taker and
    changes no other pool. In a fixed order (pairs in pool order, ties by grid order)."""
    here = pools(split)
    out: list[Split] = []
    for giver in range(len(here)):
        for taker in range(len(here)):
            if giver == taker:
                continue
            best: tuple[int, Split] | None = None
            for other in grid:
                there = pools(other)
                moved = here[giver] - there[giver]
                if moved <= 0 or there[taker] - here[taker] != moved:
                    continue
                if any(there[i] != here[i] for i in range(len(here)) if i not in (giver, taker)):
                    continue
                if best is None or moved < best[0]:
                    best = (moved, other)
            if best is not None:
                out.append(best[1])
    return out


# --- the deployment -----------------------------------------------------------------------


class Placement(msgspec.Struct, frozen=True):
    """What one device starts as: the role and replica it serves and the replica's devices."""

    role: Role
    replica: str
    devices: tuple[int, ...]


ShiftPolicyKind = Literal["none", "stages", "planner"]


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    """Where everything starts and who may move it (see the module docstring).

    ``placements``: the devices that start holding a role (the others start free).
    ``managed``: devices ``0..managed-1`` form the Controller's cluster (0: no Controller).
    ``trainer_devices``: the trainer's devices (one rank each in a real job).
    ``agent_devices``: the devices that host a role agent: those that may serve inference.
    ``roles``: the inference roles the job serves (no reward role when a checker scores).
    """

    split: Split
    placements: dict[int, Placement]
    managed: int
    trainer_devices: tuple[int, ...]
    lends_trainer: bool
    agent_devices: tuple[int, ...]
    roles: tuple[Role, ...]
    devices_per_host: int

    @property
    def kind(self) -> DeploymentKind:
        return self.split.kind

    @property
    def policy(self) -> ShiftPolicyKind:
        """How the Controller decides: the planner (pivot), the stage policy (the
        time-sharing baselines), or there is no Controller (disaggregated)."""
        if not self.managed:
            return "none"
        return "planner" if self.kind is DeploymentKind.PIVOT else "stages"

    @property
    def lent_pool(self) -> tuple[int, ...]:
        """The trainer pool the Controller lends to inference (empty when never lent)."""
        return self.trainer_devices if self.lends_trainer else ()

    def placement(self, device: int) -> Placement | None:
        return self.placements.get(device)

    def engine_roles(self, device: int) -> tuple[Role, ...]:
        """The inference roles whose engine the agent of ``device`` keeps (its persistent
        context): every role the job serves on a device the Controller may shift, else the
        one role it holds (members of a multi-device replica keep one too; only the
        leader's runs)."""
        if device < self.managed:
            return self.roles
        placed = self.placements.get(device)
        return (placed.role,) if placed is not None and placed.role in self.roles else ()

    def replicas(self, role: Role) -> int:
        """How many replicas of ``role`` the deployment starts with."""
        return len({p.replica for p in self.placements.values() if p.role is role})

    def cluster_spec(self, roles: Mapping[Role, RoleSpec]) -> ClusterSpec | None:
        """The Controller's cluster (None without one): the managed devices on hosts of
        ``devices_per_host``, the lent pool marked as the trainer's."""
        if not self.managed:
            return None
        pool = set(self.lent_pool)
        devices = [
            Device(d, d // self.devices_per_host, Pool.TRAINER if d in pool else Pool.SHARED)
            for d in range(self.managed)
        ]
        return ClusterSpec(devices, roles)


def _replicas(role: Role, first: int, count: int, size: int) -> dict[int, Placement]:
    if count % size:
        raise DeploymentError(f"{count} {role.value} devices are not whole replicas of {size}")
    out = {}
    for start in range(first, first + count, size):
        devices = tuple(range(start, start + size))
        for d in devices:
            out[d] = Placement(role, replica_id(role, devices), devices)
    return out


def plan_deployment(
    split: Split,
    sizes: Mapping[Role, int],
    *,
    devices_per_host: int,
    judged: bool = True,
    pool_held: bool = True,
) -> Deployment:
    """Where every device starts under ``split``, with replicas of ``sizes`` devices.

    ``judged``: a GenRM scores responses (else every inference device serves rollout).
    ``pool_held``: the trainer's devices start held by the trainer (a simulation measures
    from there); False: a lent pool starts free, as in a real job, whose Controller lends
    the idle pool before the first step (its recovery finds the trainer holding a pool no
    agent serves, and lends it).
    """
    n, kind = split.gpus, split.kind
    roles = INFERENCE_ROLES if judged else (Role.ROLLOUT,)
    if kind is DeploymentKind.DISAGGREGATED:
        r, m, t = split.rollout, split.reward, split.training
        if r + m + t != n or min(r, t) <= 0 or (judged and m <= 0):
            raise DeploymentError(f"split {split.label()} does not use {n} devices")
        if not judged:
            r, m = r + m, 0
        placements = {
            **_replicas(Role.ROLLOUT, 0, r, sizes[Role.ROLLOUT]),
            **_replicas(Role.REWARD, r, m, sizes[Role.REWARD]),
        }
        return _deployment(
            split, placements, 0, tuple(range(r + m, n)), False, roles, pool_held, devices_per_host
        )
    if kind is DeploymentKind.RR_COLOCATED:
        s, t = split.shared, split.training
        if s + t != n or min(s, t) <= 0:
            raise DeploymentError(f"split {split.label()} does not use {n} devices")
        placements = _replicas(Role.ROLLOUT, 0, s, sizes[Role.ROLLOUT])
        return _deployment(
            split, placements, s, tuple(range(s, n)), False, roles, pool_held, devices_per_host
        )
    if kind is DeploymentKind.COLOCATED:
        return _deployment(split, {}, n, tuple(range(n)), True, roles, pool_held, devices_per_host)
    s, t = split.shared, split.training
    # s = 0: every device is the trainer pool, lent to inference while the trainer waits
    if s + t != n or s < 0 or t < 0:
        raise DeploymentError(f"split {split.label()} does not use {n} devices")
    if split.rollout:
        rollout = split.rollout if judged else s
    else:
        unit = replica_unit(sizes)
        rollout = max(unit, s // 2 // unit * unit) if s >= 2 * unit and judged else s
    placements = {
        **_replicas(Role.ROLLOUT, 0, rollout, sizes[Role.ROLLOUT]),
        **_replicas(Role.REWARD, rollout, s - rollout, sizes[Role.REWARD]),
    }
    return _deployment(
        split, placements, n, tuple(range(s, n)), True, roles, pool_held, devices_per_host
    )


def _deployment(
    split: Split,
    placements: dict[int, Placement],
    managed: int,
    trainer: tuple[int, ...],
    lends: bool,
    roles: tuple[Role, ...],
    pool_held: bool,
    host: int,
) -> Deployment:
    if trainer and (pool_held or not lends):
        placements = {
            **placements,
            **{d: Placement(Role.TRAINING, TRAINER_ID, trainer) for d in trainer},
        }
    inference = {d for d, p in placements.items() if p.role in INFERENCE_ROLES}
    agents = tuple(sorted(inference | set(range(managed))))
    return Deployment(
        split=split,
        placements=dict(sorted(placements.items())),
        managed=managed,
        trainer_devices=trainer,
        lends_trainer=lends,
        agent_devices=agents,
        roles=roles,
        devices_per_host=host,
    )
