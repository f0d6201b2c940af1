"""What the planner and the stage policy hand the Controller: shift plans, the sequences they
migrate, decisions with their scores and timings, and the policy protocol the Controller asks
each tick. Its own module so that the shift transaction (``pivot.shift``) and the planner both
import it, and neither imports the other."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal, NamedTuple, Protocol

import msgspec

from pivot.cluster import Move, Role
from pivot.planning.snapshot import ClusterSnapshot, ReplicaState

#: The replica id of the trainer pool in plans and allocations.
TRAINER_ID = "trainer"


class DoneShift(NamedTuple):
    """A journaled shift that reached ``done``: its plan's kind and when it began and ended."""

    kind: str
    started_at: float
    done_at: float


class PhaseTimings(msgspec.Struct, frozen=True):
    preprocess_s: float = 0.0  # state analysis: arrays, baseline, bottleneck
    construction_s: float = 0.0  # slots, groups, one plan per count
    simulation_s: float = 0.0  # request-level evaluation of every candidate
    total_s: float = 0.0


class SequenceMigration(msgspec.Struct, frozen=True):
    """Abort ``seq_id`` on ``source``; dispatch it to ``target``, or to the queue when None."""

    seq_id: int
    source: str
    target: str | None


class HelperOffer(NamedTuple):
    """What to offer the train step in flight: ``replicas``, idle or to be emptied by
    ``migrations`` (each a sequence of an offered replica and the replica it moves to)."""

    replicas: tuple[ReplicaState, ...] = ()
    migrations: tuple[SequenceMigration, ...] = ()


class ShiftPlan(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["shift", "lend_trainer", "reclaim_trainer"]
    receiver: Role  # the role that gains devices (FREE when the trainer lends its pool)
    moves: tuple[Move, ...]  # evictions first, then wakes
    migrations: tuple[SequenceMigration, ...] = ()
    delta_throughput: float = 0.0  # tokens/s, objective after - before
    phi: float = 0.0  # tokens lost while the victims' sequences migrate
    expected_gain: float = 0.0  # L = H*dT - Phi (tokens)
    objective_before: float = 0.0
    objective_after: float = 0.0

    @property
    def evictions(self) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.kind == "evict")

    @property
    def wakes(self) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.kind == "wake")


class CandidateScore(msgspec.Struct, frozen=True):
    receiver: Role
    wakes: int
    victims: int
    delta_throughput: float
    phi: float
    score: float  # L


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    plan: ShiftPlan | None
    reason: str
    bottleneck: tuple[Role, ...] = ()
    objective: float = 0.0
    candidates: tuple[CandidateScore, ...] = ()
    timings: PhaseTimings = PhaseTimings()


class ShiftPolicy(Protocol):
    """What the Controller asks each tick: the ``Planner``, or a time-sharing baseline's
    ``pivot.planning.staging.StagePolicy``."""

    def decide(self, snapshot: ClusterSnapshot) -> Decision: ...

    def record_shift_time(self, seconds: float) -> None: ...

    def resume(self, done: Sequence[DoneShift]) -> None:
        """After a restart: the state the journaled shifts leave (see ``Planner.resume``)."""
        ...

    def observe_decode(self, role: Role, running: int, tokens: int, itl_s: float) -> None:
        """One measured decode iteration of a ``role`` replica (see ``Planner.observe_decode``)."""
        ...

    def helpers(self, snapshot: ClusterSnapshot, helping: Collection[str] = ()) -> HelperOffer:
        """The inference replicas to offer the train step in flight as gradient helpers
        (see ``Planner.helpers``); ``helping``: those out already."""
        ...
