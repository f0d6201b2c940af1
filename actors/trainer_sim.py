"""The simulated training backend: ``pivot.engines.sim_engine.SimTrainer`` behind the
``Trainer`` actor (``pivot.actors.trainer``), costing virtual time instead of computing.

A step trains on ``SimTrainBatch``'s token count and costs the modelled step time plus the
GPS write of the new policy; offload and reload cost the modelled shift times. Each cost is a
sleep on the clock the backend is given (the simulation's virtual one).

It takes gradient helpers: a step is rate-based (``pivot.engines.helped_step``, where the
helpers' costs are stated), and a helper that ``help`` takes shortens the step in flight; the
step's sleep ends early to recompute its end. ``reload_params_b``: per inference role, the
model (billions of parameters) a helper of that role reads back on returning, where it is not
the policy (the GenRM's, for reward).

    SimTrainingBackend(trainer, *, clock, reload_params_b={})
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

from pivot.actors.trainer import AskHelper, TrainResult
from pivot.actors.trainer_messages import GradientHelper, SimTrainBatch, TrainBatch
from pivot.bus import Clock
from pivot.engines.helped_step import HelpedStep, Helper
from pivot.engines.sim_engine import SimTrainer
from pivot.training import TrainStats


class SimTrainingBackend:
    """``TrainingBackend`` over ``trainer``, sleeping each cost on ``clock``."""

    def __init__(
        self,
        trainer: SimTrainer,
        *,
        clock: Clock,
        reload_params_b: Mapping[str, float] | None = None,
    ) -> None:
        if not trainer.awake:
            raise ValueError("a training backend starts with its state on the devices")
        self.trainer = trainer
        self.clock = clock
        self.reload_params_b = dict(reload_params_b or {})
        self._step: HelpedStep | None = None
        self._joined = asyncio.Event()

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def world_size(self) -> int:
        return self.trainer.devices

    @property
    def zero_stage(self) -> int:
        return 0  # a cost model: nothing partitioned

    @property
    def store(self) -> str | None:
        return None  # the GPS write is a cost; replicas read versions without tensors

    @property
    def takes_helpers(self) -> bool:
        return True

    async def help(self, helpers: list[GradientHelper], ask: AskHelper) -> list[str]:
        step = self._step
        if step is None:
            return []
        now = self.clock.now()
        taken = []
        for h in helpers:
            tp = len(h.devices)
            helper = Helper(
                replica=h.replica,
                devices=tuple(h.devices),
                joined_at=now,
                ready_at=now + self.trainer.helper_join_s(tp),
                return_s=self.trainer.helper_return_s(tp, self.reload_params_b.get(h.role, 0.0)),
            )
            if step.join(helper):
                taken.append(h.replica)
        if taken:
            self._joined.set()  # the step's sleep recomputes its end
        return taken

    async def start(self) -> None:
        pass  # version 0 needs no write: nothing reads tensors in a simulation

    async def prepare(self, msg: TrainBatch | SimTrainBatch) -> SimTrainBatch:
        if not isinstance(msg, SimTrainBatch):
            raise TypeError(f"a simulated trainer takes SimTrainBatch, not {type(msg).__name__}")
        if msg.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {msg.tokens}")
        return msg

    async def train(self, batch: SimTrainBatch) -> TrainResult:
        started = self.clock.now()
        step = self.trainer.train_step(batch.tokens)
        write_s = self.trainer.write_s()
        run = self._step = self.trainer.helped_step(batch.tokens, started)
        try:
            while (left := run.end() - self.clock.now()) > 1e-9:
                self._joined.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._joined.wait()
        finally:
            self._step = None
        stats = TrainStats(
            version=step.version,
            loss=0.0,
            grad_norm=0.0,
            lr=0.0,
            sequences=batch.sequences,
            tokens=batch.tokens,
            reward_mean=0.0,
            clip_fraction=0.0,
            ratio_mean=1.0,
            seconds=self.clock.now() - started,
        )
        return TrainResult(
            stats=stats,
            gps_version=step.version,
            gps_write_s=write_s,
            helpers=tuple(run.spans()),
        )

    async def offload(self) -> float:
        cost = self.trainer.offload()
        await self.clock.sleep(cost.total_s)
        return cost.total_s

    async def reload(self) -> float:
        cost = self.trainer.reload()
        await self.clock.sleep(cost.total_s)
        return cost.total_s

    async def fingerprints(self) -> list[str]:
        return []  # a simulated policy has no parameters to digest

    async def close(self) -> None:
        pass
