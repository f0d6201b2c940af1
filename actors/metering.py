"""Feeding a run's time account (``pivot.account.Ledger``) from the actors: the engines'
segments, the Controller's shift events (who is in transit, who holds which device after
each shift) and the trainer's training spans. One ledger and one account for simulated and
real runs; what differs is where the segments come from:

* a simulated agent's every engine call (``FastForward``'s ``on_segment``), in-process;
* a real agent's steps (``Threaded``), kept in its ``SegmentLog`` and published about once
  a second as ``EngineSegments`` (a real job's Monitor feeds them to its meter), so the
  agent's step loop pays a few list appends a step, never a message.

A real job's busy threshold comes from its own measurements too: the decode samples its
agents publish (``ReplicaLoad.decode_*``), refit from the planner's prior
(``measured_thresholds``).

    DeviceMeter(deployment)
        .on_segment(agent, start, out)   a FastForward hook (simulated engines)
        .on_segments(msg)                a real agent's EngineSegments
        .on_load(msg)                    a ReplicaLoad: its decode sample
        .on_shift_event(msg)             ShiftStarted / ShiftFinished / AllocationChanged
        .trained(spans)                  the trainer's TrainSpans (a simulation's, at the end)
        .on_trainer_state(msg)           a real trainer's TrainerState, with its last span
        .ledger, .lost_batches
        .measured_thresholds(priors, max_running)
    SegmentLog()                         an agent's segments until published
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pivot.account import Holder, Ledger
from pivot.actors.messages import EngineSegments, ReplicaLoad
from pivot.actors.shift_messages import AllocationChanged, ShiftFinished, ShiftStarted
from pivot.actors.trainer_messages import TrainerState
from pivot.bounds import InferenceCost, efficient_point
from pivot.cluster import Role
from pivot.deployment import Deployment
from pivot.planning.cost import CostModel, OnlineCostModel
from pivot.timeline import TrainSpan


def _holder(role: Role) -> Holder:
    if role is Role.TRAINING:
        return "trainer"
    return "free" if role is Role.FREE else "inference"


class DeviceMeter:
    """The ledger of one run of ``deployment``: who holds each device from the start (its
    placements), then what the events say."""

    def __init__(self, deployment: Deployment) -> None:
        self.ledger = Ledger()
        self.deployment = deployment
        self._managed = range(deployment.managed)
        self._holders: dict[int, Holder] = {}
        for device in range(deployment.split.gpus):
            placed = deployment.placement(device)
            self._holders[device] = _holder(placed.role) if placed is not None else "free"
        self._record(self._holders.items(), -math.inf)
        self._started: dict[int, tuple[tuple[int, ...], float]] = {}  # txn -> devices, at
        self._batches: dict[str, int] = {}  # agent -> its last EngineSegments batch
        self.lost_batches = 0  # EngineSegments batches that never arrived (pub/sub is lossy)
        # role -> decode samples (batch, KV tokens attended, latency) from the agents' loads
        self.decode_samples: dict[str, list[tuple[int, int, float]]] = {}

    def _record(self, changes: Iterable[tuple[int, Holder]], at: float) -> None:
        by_holder: dict[Holder, list[int]] = {}
        for device, holder in changes:
            by_holder.setdefault(holder, []).append(device)
        for holder, devices in by_holder.items():
            self.ledger.hold(devices, holder, at)

    def on_segment(self, agent: Any, start: float, out: Any) -> None:
        last = agent.engine.last_segment
        self.ledger.segment(
            agent.devices,
            agent.role.value,
            start,
            start + out.cost_s,
            last.running,
            last.prefill_s,
            last.reprefill_s,
        )

    def on_segments(self, msg: EngineSegments) -> None:
        last = self._batches.get(msg.agent, 0)
        self.lost_batches += max(msg.batch - last - 1, 0)
        self._batches[msg.agent] = max(last, msg.batch)
        devices = tuple(msg.devices)
        segment = self.ledger.segment
        for start, end, running, prefill_s, reprefill_s in zip(
            msg.start, msg.end, msg.running, msg.prefill_s, msg.reprefill_s, strict=True
        ):
            segment(devices, msg.role, start, end, running, prefill_s, reprefill_s)

    def on_load(self, msg: ReplicaLoad) -> None:
        if msg.decode_itl_s > 0 and msg.decode_running > 0:
            self.decode_samples.setdefault(msg.role, []).append(
                (msg.decode_running, msg.decode_tokens, msg.decode_itl_s)
            )

    def measured_thresholds(
        self, priors: Mapping[str, CostModel], max_running: int
    ) -> dict[str, int]:
        """Per inference role with decode samples, the batch from which its decoding counts
        as busy (``pivot.bounds.efficient_point``'s near batch at the mean context measured),
        by its prior refit to the samples (``OnlineCostModel``; too few keep the prior). The
        KV capacity is left unlimited: a torch engine keeps a full-length slot per sequence,
        so only ``max_running`` bounds its batch."""
        out = {}
        for role, samples in self.decode_samples.items():
            prior = priors.get(role)
            if prior is None:
                continue
            online = OnlineCostModel(prior, window=max(len(samples), 1))
            for running, tokens, itl_s in samples:
                online.observe(running, tokens, itl_s)
            context = sum(t / r for r, t, _ in samples) / len(samples)
            point = efficient_point(
                InferenceCost(
                    cost=online.refit(),
                    devices=1,
                    max_running=max_running,
                    kv_capacity_tokens=math.ceil(max_running * max(context, 1.0)),
                    prefill_tokens_per_s=prior.prefill_tokens_per_s,
                ),
                context,
            )
            out[role] = point.near_batch
        return out

    def on_shift_event(self, msg: object) -> None:
        if isinstance(msg, ShiftStarted):
            devices = sorted({d for move in msg.moves for d in move.devices})
            self._started[msg.txn] = (tuple(devices), msg.at)
        elif isinstance(msg, ShiftFinished):
            started = self._started.pop(msg.txn, None)
            if started is not None:  # (a shift a restarted Controller finished: not seen)
                self.ledger.transit(started[0], started[1], msg.at)
        elif isinstance(msg, AllocationChanged):
            now: dict[int, Holder] = dict.fromkeys(self._managed, "free")
            for move in msg.replicas:
                for d in move.devices:
                    now[d] = _holder(Role(move.role))
            changed = [(d, h) for d, h in now.items() if self._holders.get(d) != h]
            self._holders.update(changed)
            self._record(changed, msg.at)

    def trained(self, spans: Iterable[TrainSpan]) -> None:
        devices = self.deployment.trainer_devices
        for span in spans:
            # its gradient helpers: in transit while they join and return, training while
            # they compute
            for h in span.helpers:
                self.ledger.transit(h.devices, h.joined_at, h.ready_at)
                self.ledger.training(h.devices, h.ready_at, h.reduced_at)
                self.ledger.transit(h.devices, h.reduced_at, h.back_at)
            self.ledger.training(devices, span.start, span.end)

    def on_trainer_state(self, msg: TrainerState) -> None:
        """A real trainer's state: the step it just trained, if it says one."""
        if msg.span is not None:
            self.ledger.training(self.deployment.trainer_devices, *msg.span)


class SegmentLog:
    """A real agent's engine segments not yet published (columns, as ``EngineSegments``
    carries them). A step that follows the one before while the engine still held work
    extends it to its own start (the agent's loop between steps serves the same sequences),
    and joins it when it held as many sequences and prefilled nothing: a steady decode is
    one segment however many steps it takes. ``take`` hands out what is closed."""

    def __init__(self) -> None:
        self.start: list[float] = []
        self.end: list[float] = []
        self.running: list[int] = []
        self.prefill_s: list[float] = []
        self.reprefill_s: list[float] = []
        self.batches = 0
        self._continues = False  # the last segment runs on until the next step starts

    def __len__(self) -> int:
        return len(self.start)

    def step(
        self,
        start: float,
        end: float,
        running: int,
        prefill_s: float,
        reprefill_s: float,
        *,
        more: bool,
    ) -> None:
        """A step from ``start`` to ``end`` held ``running`` sequences; ``more``: the engine
        still holds work after it."""
        if self._continues and self.end:
            self.end[-1] = max(self.end[-1], start)
            if running == self.running[-1] and prefill_s <= 0:
                self.end[-1] = end
                self._continues = more
                return
        self.start.append(start)
        self.end.append(end)
        self.running.append(running)
        self.prefill_s.append(prefill_s)
        self.reprefill_s.append(reprefill_s)
        self._continues = more

    def idle(self, at: float) -> None:
        """The engine's work was taken away at ``at`` (an abort of everything)."""
        if self._continues and self.end:
            self.end[-1] = max(self.end[-1], at)
        self._continues = False

    def take(self, *, everything: bool = False) -> dict[str, list] | None:
        """The closed segments as ``EngineSegments`` columns (with ``everything``, the open
        one too, which then ends where it is), or None when there are none."""
        keep = 1 if self._continues and not everything else 0
        if len(self.start) <= keep:
            return None
        if everything:
            self._continues = False
        cut = len(self.start) - keep
        columns = {}
        for name in ("start", "end", "running", "prefill_s", "reprefill_s"):
            values = getattr(self, name)
            columns[name] = values[:cut]
            setattr(self, name, values[cut:])
        self.batches += 1
        return columns
