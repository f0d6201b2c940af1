"""The planner's input: an immutable snapshot of replicas, queues and the trainer at one time.

Built by whoever watches the cluster (the Controller from metrics, the simulator from its
state) and handed to the planner as is. Per replica it carries the running sequences as two
parallel tuples (ids, tokens so far = prompt + generated): flat tuples of ints are cheap to
build from metrics and cheap to turn into numpy arrays, even at 1024 devices with thousands
of sequences. Queues are summarised by length and token total: the planner routes them as a
batch and never needs their ids.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from pivot.cluster import Allocation, ClusterSpec, Replica, Role


class SnapshotError(ValueError):
    """A snapshot that contradicts itself or the cluster; the message says where."""


class TrainerPhase(StrEnum):
    WAITING = "waiting"  # for a batch: its pool may be lent to inference
    TRAINING = "training"  # holds the whole trainer pool
    READY = "ready"  # a batch is ready: the pool must come back whole


class ReplicaState(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    role: Role
    devices: tuple[int, ...]
    seq_ids: tuple[int, ...] = ()
    seq_tokens: tuple[int, ...] = ()  # per running sequence: prompt + generated so far
    itl_s: float = 0.0  # measured inter-token latency; 0 when not measured yet
    woken_at: float | None = None  # when the replica came up; None: before the planner's time

    @property
    def running(self) -> int:
        return len(self.seq_ids)


class QueueState(msgspec.Struct, frozen=True):
    length: int = 0
    tokens: int = 0  # prompt + generated tokens of everything waiting


class ClusterSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    now: float
    replicas: tuple[ReplicaState, ...]
    rollout_queue: QueueState = msgspec.field(default_factory=QueueState)
    reward_queue: QueueState = msgspec.field(default_factory=QueueState)
    trainer: TrainerPhase = TrainerPhase.WAITING
    # seconds until the batch the trainer waits for is predicted ready (None: no forecast),
    # and how long taking its pool back takes (measured; 0: never measured)
    trainer_ready_in_s: float | None = None
    trainer_reclaim_s: float = 0.0
    # whether the trainer's backend takes gradient helpers (pivot.planning.helpers)
    trainer_takes_helpers: bool = False
    shift_in_flight: bool = False

    def queue(self, role: Role) -> QueueState:
        if role is Role.ROLLOUT:
            return self.rollout_queue
        if role is Role.REWARD:
            return self.reward_queue
        raise SnapshotError(f"role {role.value!r} has no waiting queue")

    def allocation(self, spec: ClusterSpec) -> Allocation:
        return Allocation(spec, (Replica(r.id, r.role, r.devices) for r in self.replicas))


def validate_snapshot(spec: ClusterSpec, snapshot: ClusterSnapshot) -> None:
    """Full consistency check (O(sequences)); the planner itself only does cheap checks."""
    snapshot.allocation(spec)
    seen: dict[int, str] = {}
    for replica in snapshot.replicas:
        if len(replica.seq_ids) != len(replica.seq_tokens):
            raise SnapshotError(
                f"replica {replica.id!r}: {len(replica.seq_ids)} sequence ids but "
                f"{len(replica.seq_tokens)} token counts"
            )
        if replica.role is Role.TRAINING and replica.seq_ids:
            raise SnapshotError(f"training replica {replica.id!r} runs sequences")
        for seq_id in replica.seq_ids:
            other = seen.setdefault(seq_id, replica.id)
            if other != replica.id:
                raise SnapshotError(f"sequence {seq_id} runs on both {other!r} and {replica.id!r}")
        if len(set(replica.seq_ids)) != len(replica.seq_ids):
            raise SnapshotError(f"replica {replica.id!r} lists a sequence twice")
    for role in (Role.ROLLOUT, Role.REWARD):
        q = snapshot.queue(role)
        if q.length < 0 or q.tokens < 0 or (q.length == 0 and q.tokens != 0):
            raise SnapshotError(f"{role.value} queue: length {q.length}, tokens {q.tokens}")
