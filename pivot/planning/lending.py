"""What the planner learns online about this machine: whether lending the trainer pool
makes a step's inference faster.

Lending is the planner's one move that adds devices, and the cost model prices each lent
device as one more replica decoding at its own speed. A CPU "device" that shares its cores
with the others adds an engine process, not compute, and then lending buys only shifts. So
``LendingLedger`` measures it: each step's inference time (from the trainer starting to wait
for a batch until the batch is ready) with the pool lent and with it kept. After
``warmup_steps`` steps it tries each in turn (lend, keep, lend, ...) until both have
``trials`` steps, then lends only where the mean step with lending is shorter than the one
without by ``min_gain`` (a fraction): a move must pay for itself. The chosen way goes on
being measured, so a machine that gets busier or quieter moves the mean it is judged by.

Pure: the time and the trainer's phase are the snapshot's. The ledger lives as long as its
Planner (a restarted Controller learns again).
"""

from __future__ import annotations

from pivot.config import ConfigStruct, NonNegativeFloat, NonNegativeInt, PositiveInt
from pivot.planning.snapshot import ClusterSnapshot, TrainerPhase


class LendingSettings(ConfigStruct, kw_only=True):
    learn: bool = False  # off: lend whenever the trainer waits (lend_trainer_pool)
    warmup_steps: NonNegativeInt = 1  # steps not measured (start-up: imports, first batch)
    trials: PositiveInt = 2  # steps measured each way before choosing
    min_gain: NonNegativeFloat = 0.05  # lending must shorten a step by this fraction


class LendingLedger:
    """Steps measured with the pool lent and kept (see the module docstring)."""

    def __init__(self, settings: LendingSettings | None = None) -> None:
        self.settings = settings or LendingSettings()
        self.seconds: dict[bool, list[float]] = {True: [], False: []}  # lent? -> step times
        self.steps = 0  # waits seen to their end
        self.lending = True  # the way of the step now waiting
        self._since: float | None = None

    def observe(self, snapshot: ClusterSnapshot) -> None:
        """One tick's snapshot: a wait starts (choose how it runs) or ends (measure it)."""
        waiting = snapshot.trainer is TrainerPhase.WAITING
        if waiting and self._since is None:
            self._since = snapshot.now
            self.lending = self._choose()
        elif not waiting and self._since is not None:
            if self.steps >= self.settings.warmup_steps:
                self.seconds[self.lending].append(snapshot.now - self._since)
            self.steps += 1
            self._since = None

    def _choose(self) -> bool:
        s = self.settings
        if self.steps < s.warmup_steps:
            return True
        lent, kept = self.seconds[True], self.seconds[False]
        if len(lent) < s.trials or len(kept) < s.trials:
            return len(lent) <= len(kept)  # explore: lend first, then alternate
        return self.pays()

    def pays(self) -> bool:
        """Whether lending has been seen to pay for itself (True until both were tried)."""
        lent, kept = self.seconds[True], self.seconds[False]
        if not lent or not kept:
            return True
        mean_lent, mean_kept = sum(lent) / len(lent), sum(kept) / len(kept)
        return mean_lent < mean_kept * (1.0 - self.settings.min_gain)
