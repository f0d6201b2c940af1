"""A run's events: what a job tells the people watching it, as records.

The job publishes them in batches for live watchers (best effort), answers a snapshot for a
watcher that joins late, and appends every one to ``RUN/events.jsonl`` for replay
(``pivot monitor``, ``pivot report``). Each record's ``t`` is seconds since the job began
starting its processes (``pivot.actors.event_hub.EventHub``'s origin, before the Monitor's
first sample: timeline.jsonl's ``t`` runs behind it by the start-up); ``"type"`` says which
record a line of events.jsonl is, so
``msgspec.json.Decoder(EventRecord)`` reads any of them.
"""

from __future__ import annotations

import msgspec


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    t: float


class JobPhase(Event, tag="phase"):
    """What the job is doing: ``starting`` (with ``detail``: loading models, starting agents,
    building DeepSpeed, waiting for replicas), ``running``, ``finished``, ``stopped``,
    ``failed``, ``interrupted`` (a signal). ``steps``: the job's steps; ``deployment``: its kind."""

    phase: str
    detail: str = ""
    steps: int = 0
    deployment: str = ""


class StepDone(Event, tag="step"):
    """A step's report, as metrics.jsonl holds it (``pivot.actors.driver.StepReport``)."""

    step: int
    report: dict


class RoleRate(Event, tag="role"):
    """An inference role's throughput and sequences, sampled every monitor interval."""

    role: str
    tokens_per_s: float
    running: int
    queued: int


class DeviceMap(Event, tag="devices"):
    """Which role (and replica) each device serves now: one lane per device.
    ``roles[device]`` is a role name (``rollout``, ``reward``, ``training``, ``free``)."""

    roles: dict[int, str]
    replicas: dict[int, str] = {}


class ShiftPhase(Event, tag="shift"):
    """A shift transaction reached ``phase`` (``started`` ... ``done``/``aborted``) after
    ``seconds``; ``kind``: shift, lend_trainer, reclaim_trainer."""

    txn: int
    kind: str
    phase: str
    seconds: float = 0.0
    devices: list[int] = []


class TrainerPhase(Event, tag="trainer"):
    """The trainer's state (waiting, training, lent, reclaiming) and its policy version."""

    phase: str
    version: int = 0


class PlannerDecision(Event, tag="decision"):
    """The planner's latest decision: the bottleneck role, the best candidate's figures
    (L = H * dT - Phi), and whether it acted and why (or why not)."""

    bottleneck: str
    acted: bool
    why: str
    candidate: str = ""
    horizon_s: float = 0.0
    throughput_gain: float = 0.0  # dT
    cost: float = 0.0  # Phi
    value: float = 0.0  # L


class ActorRestarted(Event, tag="restart"):
    actor: str
    cause: str = ""


class Alert(Event, tag="alert"):
    """Something a person should look at: ``kind`` is reward_failures, slow_shift,
    restart, slow_step, or another short name; ``message`` one line."""

    kind: str
    message: str


EventRecord = (
    JobPhase
    | StepDone
    | RoleRate
    | DeviceMap
    | ShiftPhase
    | TrainerPhase
    | PlannerDecision
    | ActorRestarted
    | Alert
)

EVENTS_FILE = "events.jsonl"
