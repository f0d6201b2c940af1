"""The cluster model: devices on hosts, the two pools, role specs, replicas and the allocation.

A device belongs to one pool (shared, or the trainer pool that training owns as a whole) and
holds at most one role at a time, through the one replica that owns it. A replica owns whole
devices; its size comes from its role's parallel layout, so sizes may differ per role (1-device
rollout replicas beside 4-device reward replicas). The ``Allocation`` is the validated map
from devices to replicas; a shift plan's moves turn one allocation into the next.

Device ids are 0..N-1 in order, so that the planner can index numpy arrays by device id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Literal

import msgspec
import numpy as np

from pivot.config import ConfigStruct, NonNegativeInt, PositiveInt


class ClusterError(ValueError):
    """A cluster description, allocation or move that cannot be right; the message says why."""


class Role(StrEnum):
    ROLLOUT = "rollout"
    REWARD = "reward"
    TRAINING = "training"
    FREE = "free"  # the role of a device that no replica holds; never a replica's role


INFERENCE_ROLES: tuple[Role, Role] = (Role.ROLLOUT, Role.REWARD)


def other_inference_role(role: Role) -> Role:
    if role is Role.ROLLOUT:
        return Role.REWARD
    if role is Role.REWARD:
        return Role.ROLLOUT
    raise ClusterError(f"{role.value!r} is not an inference role")


def replica_id(role: Role, devices: tuple[int, ...]) -> str:
    """A replica's name: its role at its first device (the planner appends ``#n`` to a name
    still taken by a replica that is being evicted)."""
    return f"{role.value}@{devices[0]}"


def replica_role(replica: str) -> Role:
    """The role ``replica_id`` named the replica by."""
    return Role(replica.partition("@")[0])


class Pool(StrEnum):
    SHARED = "shared"
    TRAINER = "trainer"  # lent to inference while the trainer waits, reclaimed whole when ready


class ReplicaLayout(ConfigStruct):
    """Parallel layout of one replica; its device count is tp * pp (experts ride on tp)."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1

    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def key(self) -> str:
        # the key cost-model files use for this layout
        return f"TP{self.tp}_PP{self.pp}"


class RoleSpec(ConfigStruct):
    """What one inference role runs: the model, the layout of each replica, its KV capacity."""

    model: str
    layout: ReplicaLayout = ReplicaLayout()
    # per replica; only the rule-based planner (KV-threshold ablation) reads it
    kv_capacity_tokens: PositiveInt = 262_144

    @property
    def replica_size(self) -> int:
        return self.layout.size


class ClusterConfig(ConfigStruct, kw_only=True):
    """A homogeneous cluster as written in TOML: hosts x devices, the last hosts the trainer's."""

    hosts: PositiveInt
    devices_per_host: PositiveInt
    trainer_hosts: NonNegativeInt = 0
    rollout: RoleSpec
    reward: RoleSpec


class Device(msgspec.Struct, frozen=True):
    id: int
    host: int
    pool: Pool = Pool.SHARED


class Replica(msgspec.Struct, frozen=True):
    """A replica of one role on whole devices. ``id`` is unique within an allocation."""

    id: str
    role: Role
    devices: tuple[int, ...]


class Move(msgspec.Struct, frozen=True):
    """One step of a shift: ``evict`` shifts a replica down, ``wake`` shifts one up."""

    kind: Literal["evict", "wake"]
    replica_id: str
    role: Role
    devices: tuple[int, ...]


class ClusterSpec:
    """The static part of a cluster: devices, pools and what each inference role runs.

    Built once per job; the planner caches per-role slot tables on it.
    """

    def __init__(self, devices: Iterable[Device], roles: Mapping[Role, RoleSpec]) -> None:
        self.devices: tuple[Device, ...] = tuple(devices)
        if not self.devices:
            raise ClusterError("a cluster needs at least one device")
        for index, device in enumerate(self.devices):
            if device.id != index:
                raise ClusterError(
                    f"device ids must be 0..{len(self.devices) - 1} in order; "
                    f"position {index} holds device {device.id}"
                )
        for role in INFERENCE_ROLES:
            if role not in roles:
                raise ClusterError(f"no spec for role {role.value!r}")
        extra = set(roles) - set(INFERENCE_ROLES)
        if extra:
            names = ", ".join(sorted(r.value for r in extra))
            raise ClusterError(f"role specs are for rollout and reward only, found {names}")
        self.roles: dict[Role, RoleSpec] = dict(roles)
        self.host = np.array([d.host for d in self.devices], dtype=np.int64)
        self.is_trainer_pool = np.array([d.pool is Pool.TRAINER for d in self.devices])
        self.trainer_pool: tuple[int, ...] = tuple(
            d.id for d in self.devices if d.pool is Pool.TRAINER
        )
        self._slots: dict[Role, np.ndarray] = {}
        for role in INFERENCE_ROLES:
            self.slots(role)  # a layout that fits no host is an error now, not at planning

    @classmethod
    def from_config(cls, config: ClusterConfig) -> ClusterSpec:
        if config.trainer_hosts > config.hosts:
            raise ClusterError(
                f"trainer_hosts ({config.trainer_hosts}) exceeds hosts ({config.hosts})"
            )
        first_trainer_host = config.hosts - config.trainer_hosts
        devices = [
            Device(
                id=h * config.devices_per_host + i,
                host=h,
                pool=Pool.TRAINER if h >= first_trainer_host else Pool.SHARED,
            )
            for h in range(config.hosts)
            for i in range(config.devices_per_host)
        ]
        return cls(devices, {Role.ROLLOUT: config.rollout, Role.REWARD: config.reward})

    @property
    def size(self) -> int:
        return len(self.devices)

    def replica_size(self, role: Role) -> int:
        if role is Role.TRAINING:
            return len(self.trainer_pool)
        return self.roles[role].replica_size

    def slots(self, role: Role) -> np.ndarray:
        """Device groups where a new replica of ``role`` may be placed: (slots, size) int array.

        Blocks are aligned within a host; a replica larger than a host takes whole, consecutive
        hosts of equal size. Devices left over at the end of a host are no slot's.
        """
        cached = self._slots.get(role)
        if cached is not None:
            return cached
        k = self.replica_size(role)
        by_host: dict[int, list[int]] = {}
        for device in self.devices:
            by_host.setdefault(device.host, []).append(device.id)
        hosts = [by_host[h] for h in sorted(by_host)]
        blocks: list[list[int]] = []
        host_size = len(hosts[0])
        if k <= min(len(h) for h in hosts):
            for devs in hosts:
                blocks.extend(devs[i : i + k] for i in range(0, len(devs) - k + 1, k))
        elif all(len(h) == host_size for h in hosts) and k % host_size == 0:
            per = k // host_size
            for i in range(0, len(hosts) - per + 1, per):
                blocks.append([d for h in hosts[i : i + per] for d in h])
        else:
            raise ClusterError(
                f"a {role.value} replica of {k} devices fits neither inside a host nor on "
                f"whole hosts (host sizes {sorted({len(h) for h in hosts})})"
            )
        table = np.array(blocks, dtype=np.int64).reshape(len(blocks), k)
        self._slots[role] = table
        return table


class Allocation:
    """A validated assignment of replicas to devices; ``apply`` gives the next one."""

    def __init__(self, spec: ClusterSpec, replicas: Iterable[Replica]) -> None:
        self.spec = spec
        self.replicas: dict[str, Replica] = {}
        self._owner: dict[int, str] = {}
        trainer_pool = set(spec.trainer_pool)
        for replica in replicas:
            if replica.id in self.replicas:
                raise ClusterError(f"replica id {replica.id!r} is used twice")
            if replica.role is Role.FREE:
                raise ClusterError(f"replica {replica.id!r} has role 'free', which is no role")
            if not replica.devices:
                raise ClusterError(f"replica {replica.id!r} holds no device")
            for device in replica.devices:
                if not 0 <= device < spec.size:
                    raise ClusterError(
                        f"replica {replica.id!r} names device {device}, but the cluster has "
                        f"devices 0..{spec.size - 1}"
                    )
                holder = self._owner.get(device)
                if holder is not None:
                    raise ClusterError(
                        f"device {device} is held by both {holder!r} and {replica.id!r}"
                    )
                self._owner[device] = replica.id
            if replica.role is Role.TRAINING:
                if set(replica.devices) != trainer_pool or len(replica.devices) != len(
                    trainer_pool
                ):
                    raise ClusterError(
                        f"training replica {replica.id!r} must hold the whole trainer pool "
                        f"{sorted(trainer_pool)}, holds {sorted(replica.devices)}"
                    )
                if any(r.role is Role.TRAINING for r in self.replicas.values()):
                    raise ClusterError("more than one training replica")
            else:
                want = spec.replica_size(replica.role)
                if len(replica.devices) != want:
                    raise ClusterError(
                        f"{replica.role.value} replica {replica.id!r} holds "
                        f"{len(replica.devices)} devices; its layout needs {want}"
                    )
            self.replicas[replica.id] = replica

    def owner_of(self, device: int) -> str | None:
        return self._owner.get(device)

    def role_of(self, device: int) -> Role:
        owner = self._owner.get(device)
        return Role.FREE if owner is None else self.replicas[owner].role

    def free_devices(self, pool: Pool | None = None) -> list[int]:
        return [
            d.id
            for d in self.spec.devices
            if d.id not in self._owner and (pool is None or d.pool is pool)
        ]

    def of_role(self, role: Role) -> list[Replica]:
        return [r for r in self.replicas.values() if r.role is role]

    def apply(self, moves: Iterable[Move]) -> Allocation:
        """The allocation after ``moves`` in order; a move that does not fit is a ClusterError."""
        replicas = dict(self.replicas)
        for move in moves:
            if move.kind == "evict":
                current = replicas.get(move.replica_id)
                if current is None:
                    raise ClusterError(f"evict {move.replica_id!r}: no such replica")
                if current.role is not move.role or current.devices != move.devices:
                    raise ClusterError(
                        f"evict {move.replica_id!r}: move says {move.role.value} on "
                        f"{list(move.devices)}, replica is {current.role.value} on "
                        f"{list(current.devices)}"
                    )
                del replicas[move.replica_id]
            else:
                if move.replica_id in replicas:
                    raise ClusterError(f"wake {move.replica_id!r}: the id is already in use")
                replicas[move.replica_id] = Replica(move.replica_id, move.role, move.devices)
        # the constructor checks that no device is held twice and that sizes fit
        return Allocation(self.spec, replicas.values())
