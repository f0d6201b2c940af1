"""Feeding a run's time account (``pivot.account.Ledger``) from the actors: every engine call
of a simulated agent (``FastForward``'s ``on_segment``), the Controller's shift events (who is
in transit, who holds which device after each shift) and the trainer's training spans.

The same events exist in a real job (agents' load reports, the same shift events, the
trainer's spans), so a real job's account can be fed through the same ``Ledger``.

    DeviceMeter(deployment)
        .on_segment(agent, start, out)   a FastForward hook (simulated engines)
        .on_shift_event(msg)             ShiftStarted / ShiftFinished / AllocationChanged
        .trained(spans)                  the trainer's TrainSpans, at the end
        .ledger
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from pivot.account import Holder, Ledger
from pivot.actors.shift_messages import AllocationChanged, ShiftFinished, ShiftStarted
from pivot.cluster import Role
from pivot.deployment import Deployment
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
