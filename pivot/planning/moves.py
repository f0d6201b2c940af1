"""What the planner learns online about this machine: whether its moves (lending the trainer
pool, shifting devices between rollout and reward) make a step's inference faster.

The cost model prices each lent device as one more replica decoding at its own speed, and a
role shift as the sequences it evicts. A CPU "device" that shares its cores with the others
adds an engine process, not compute, and a shift there costs the cores its aborts,
re-prefills and weight reads: on the tiny job (4 devices on 2 cores) PivotRL with every move
ran at 0.83x disaggregated's samples/s, with its split held at 1.0x (``max_running`` 32); with
the whole batch on a replica (128) its steps take 1.9-2.4 s moving, 1.6-1.8 s held, as
disaggregated's. So ``MoveLedger``
measures it: each step's inference time (from the trainer starting to wait for a batch until
the batch is ready) with the planner moving and with it holding. After ``warmup_steps`` steps
it tries each in turn (move, hold, move, ...) until both have ``trials`` steps, then moves only
where the mean step with moves is shorter than the one without by ``min_gain`` (a fraction):
a move must pay for itself. The chosen way goes on being measured, so a machine that gets
busier or quieter moves the mean it is judged by.

Holding (``PlannerSettings.shift_roles`` and ``lend_trainer_pool`` off for the step) keeps the
trainer pool and the split between rollout and reward; a role with work and no replica still
takes one.

Pure: the time and the trainer's phase are the snapshot's. The ledger lives as long as its
Planner (a restarted Controller learns again).
"""

from __future__ import annotations

from pivot.config import ConfigStruct, NonNegativeFloat, NonNegativeInt, PositiveInt
from pivot.planning.snapshot import ClusterSnapshot, TrainerPhase


class MoveLearning(ConfigStruct, kw_only=True):
    learn: bool = False  # off: move wherever the planner's objective says it pays
    warmup_steps: NonNegativeInt = 1  # steps not measured (start-up: imports, first batch)
    trials: PositiveInt = 2  # steps measured each way before choosing
    min_gain: NonNegativeFloat = 0.05  # moving must shorten a step by this fraction


class MoveLedger:
    """Steps measured with the planner moving and holding (see the module docstring)."""

    def __init__(self, settings: MoveLearning | None = None) -> None:
        self.settings = settings or MoveLearning()
        self.seconds: dict[bool, list[float]] = {True: [], False: []}  # moving? -> step times
        self.steps = 0  # waits seen to their end
        self.moving = True  # the way of the step now waiting
        self._since: float | None = None

    def observe(self, snapshot: ClusterSnapshot) -> None:
        """One tick's snapshot: a wait starts (choose how it runs) or ends (measure it)."""
        waiting = snapshot.trainer is TrainerPhase.WAITING
        if waiting and self._since is None:
            self._since = snapshot.now
            self.moving = self._choose()
        elif not waiting and self._since is not None:
            if self.steps >= self.settings.warmup_steps:
                self.seconds[self.moving].append(snapshot.now - self._since)
            self.steps += 1
            self._since = None

    def _choose(self) -> bool:
        s = self.settings
        if self.steps < s.warmup_steps:
            return True
        moved, held = self.seconds[True], self.seconds[False]
        if len(moved) < s.trials or len(held) < s.trials:
            return len(moved) <= len(held)  # explore: move first, then alternate
        return self.pays()

    def pays(self) -> bool:
        """Whether moving has been seen to pay for itself (True until both were tried)."""
        moved, held = self.seconds[True], self.seconds[False]
        if not moved or not held:
            return True
        mean_moved, mean_held = sum(moved) / len(moved), sum(held) / len(held)
        return mean_moved < mean_held * (1.0 - self.settings.min_gain)
