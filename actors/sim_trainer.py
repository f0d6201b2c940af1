"""The training role in a simulation: an actor over ``pivot.engines.sim_engine.SimTrainer`` that answers
the Driver's ``SimTrainBatch`` and the Controller's trainer messages the way the real trainer
actor (``pivot.actors.trainer``) does, costing virtual time instead of computing.

* ``SimTrainBatch`` -> ``Trained`` (``stats.version`` is the new policy version). A step costs
  the trainer's modelled step time plus the GPS write of the new policy. A batch that arrives
  while the pool is lent does not train on devices inference holds: the trainer reports
  ``training`` (the Controller reads that as "ready": reclaim the pool), tells the Controller
  at once with ``TrainerPhaseChanged(ready)``, and trains once ``ReloadTrainer`` gave the pool
  back.
* ``OffloadTrainer`` (lend the pool) and ``ReloadTrainer`` (take it back) cost the modelled
  offload and wake times; both are idempotent. ``QueryTrainer`` -> ``TrainerStatus``.

    SimTrainerActor(name, bus, *, trainer, controller=None)
        .spans: [TrainSpan]   when each step trained (for the timeline)
        .offloads, .reloads, .shift_s   how often and how long the pool moved
"""

from __future__ import annotations

import asyncio
import contextlib

from pivot.actors.shift_messages import TrainerPhaseChanged
from pivot.actors.trainer_messages import (
    OffloadTrainer,
    QueryTrainer,
    ReloadTrainer,
    SimTrainBatch,
    Trained,
    TrainerState,
    TrainerStateName,
    TrainerStatus,
)
from pivot.bus import Actor, Bus, BusError, handles
from pivot.engines.sim_engine import SimTrainer
from pivot.timeline import TrainSpan
from pivot.training import TrainStats


class TrainerBusy(RuntimeError):
    """A request the trainer cannot honour now (a second batch, an offload mid-step)."""


class SimTrainerActor(Actor):
    """The simulated trainer; ``controller`` is told when a batch waits for the lent pool."""

    def __init__(
        self, name: str, bus: Bus, *, trainer: SimTrainer, controller: str | None = None
    ) -> None:
        super().__init__(name, bus)
        self.trainer = trainer
        self.controller = controller
        self.spans: list[TrainSpan] = []
        self.offloads = 0
        self.reloads = 0
        self.shift_s = 0.0
        self._trainer_state: TrainerStateName = "idle" if trainer.awake else "offloaded"
        self._pending = False
        self._awake = asyncio.Event()
        if trainer.awake:
            self._awake.set()
        # one of train / offload / reload at a time, as on real devices
        self._lock = asyncio.Lock()

    @property
    def state(self) -> TrainerStateName:
        return self._trainer_state

    def _status(self, seconds: float = 0.0) -> TrainerStatus:
        return TrainerStatus(
            name=self.name,
            state=self._trainer_state,
            version=self.trainer.version,
            world_size=self.trainer.devices,
            zero_stage=0,
            steps=self.trainer.steps,
            store=None,
            seconds=seconds,
            holds_pool=self.trainer.awake,
        )

    async def _set_state(self, state: TrainerStateName) -> None:
        self._trainer_state = state
        await self.publish(
            "trainer", TrainerState(name=self.name, state=state, version=self.trainer.version)
        )

    @handles
    async def train(self, msg: SimTrainBatch) -> Trained:
        if self._pending:
            raise TrainerBusy(f"step {msg.step} arrived while another step is in flight")
        self._pending = True
        try:
            await self._set_state("training")
            if not self._awake.is_set():
                await self._ask_for_pool()
                await self._awake.wait()
            async with self._lock:
                started = self.clock.now()
                step = self.trainer.train_step(msg.tokens)
                write_s = self.trainer.write_s()
                await self.clock.sleep(step.cost_s + write_s)
                ended = self.clock.now()
        finally:
            self._pending = False
        await self._set_state("idle" if self.trainer.awake else "offloaded")
        self.spans.append(TrainSpan(start=started, end=ended, version=step.version))
        stats = TrainStats(
            version=step.version,
            loss=0.0,
            grad_norm=0.0,
            lr=0.0,
            sequences=msg.sequences,
            tokens=msg.tokens,
            reward_mean=0.0,
            clip_fraction=0.0,
            ratio_mean=1.0,
            seconds=ended - started,
        )
        return Trained(step=msg.step, stats=stats, gps_version=step.version, gps_write_s=write_s)

    async def _ask_for_pool(self) -> None:
        if self.controller is None:
            raise TrainerBusy("the pool is lent and no controller is named to take it back")
        # best effort: the Controller also sees "training" without its pool at its next tick
        with contextlib.suppress(BusError):
            await self.request(self.controller, TrainerPhaseChanged(phase="ready"))

    @handles
    async def offload(self, msg: OffloadTrainer) -> TrainerStatus:
        async with self._lock:
            if not self.trainer.awake:
                return self._status()
            if self._pending:
                raise TrainerBusy("a batch is waiting to train: the pool cannot be lent now")
            cost = self.trainer.offload()
            self._awake.clear()
            await self.clock.sleep(cost.total_s)
            self.offloads += 1
            self.shift_s += cost.total_s
            # a batch that came in meanwhile keeps the trainer "training": it wants the pool
            await self._set_state("training" if self._pending else "offloaded")
            return self._status(cost.total_s)

    @handles
    async def reload(self, msg: ReloadTrainer) -> TrainerStatus:
        async with self._lock:
            if self.trainer.awake:
                return self._status()
            cost = self.trainer.reload()
            await self.clock.sleep(cost.total_s)
            self.reloads += 1
            self.shift_s += cost.total_s
            self._awake.set()
            if not self._pending:
                await self._set_state("idle")
            return self._status(cost.total_s)

    @handles
    def query(self, msg: QueryTrainer) -> TrainerStatus:
        return self._status()
