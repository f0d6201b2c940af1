"""The test kit's faults for real processes, named in the job's environment: how the e2e
tests kill a child at a chosen point of its work, deterministically, where a kill from
outside would land at a random one. ``PIVOT_FAULT`` holds comma-separated entries
``kind:argument...``; this module is the one place that reads it.

* ``kill-agent:NAME:STEPS[:ROLE]``: the agent process NAME SIGKILLs itself (no cleanup, no
  FAILED line: as ``kill -9``) right after its STEPS-th engine step (counting only steps in
  ROLE, when given), in its first start only, so that its restart runs undisturbed. NAME
  ``*``: the first agent process to get there, whichever the planner put in ROLE, a restarted
  one too (one per entry: it claims the entry with a file in ``PIVOT_FAULT_DIR``), so that the
  kill comes whatever the planner does with the agents.
* ``kill-controller:RECORD[:RECORD...]``: the Controller's process SIGKILLs itself right
  before it writes its RECORD-th shift journal record (1-based): the first RECORD for its
  first start, the second for its first restart, and so on; a start past the list runs
  undisturbed. A crash at a chosen phase of a chosen shift, then at one of the shift its
  recovery finishes or of a later one.
* ``crash-in-step:VERSION[:RANK]``: trainer rank RANK (0 by default) SIGKILLs itself in the
  step that makes policy version VERSION, between its backward and its update; in its
  group's first start only.
* ``crash-in-checkpoint:VERSION[:RANK]``: trainer rank RANK (0 by default) exits 70 while it
  saves the checkpoint of policy version VERSION, the policy written and the rest not; in
  its group's first start only.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from pivot.actors.agent import RoleAgent, Threaded
from pivot.actors.journal import Journal
from pivot.bus.supervisor import START_ENV
from pivot.cluster import Role
from pivot.engines.protocol import InferenceEngine

FAULT_ENV = "PIVOT_FAULT"
#: where the agents of one job claim a ``kill-agent:*`` entry (a folder they share)
FAULT_DIR_ENV = "PIVOT_FAULT_DIR"


def planned(kind: str) -> list[list[str]]:
    """The arguments of every ``kind`` entry in ``PIVOT_FAULT``."""
    entries = (e.strip() for e in os.environ.get(FAULT_ENV, "").split(","))
    return [e.split(":")[1:] for e in entries if e.split(":")[0] == kind]


def start_count() -> int:
    """How often this child process was started before (0: its first start)."""
    return int(os.environ.get(START_ENV, "0"))


def first_start() -> bool:
    """This child process is its supervisor's first start of it (not a restart)."""
    return start_count() == 0


class Kill(NamedTuple):
    """One planned kill of an agent: after ``steps`` engine steps (in ``role`` only, when
    given); with ``claim``, only if the claim (a path no other process created first) is
    its own."""

    steps: int
    role: Role | None = None
    claim: Path | None = None


class KilledAfterSteps(Threaded):
    """``Threaded`` stepping that SIGKILLs its process as ``kills`` plan; a kill whose claim
    went to another agent is dropped and the agent runs on."""

    def __init__(self, *kills: Kill) -> None:
        self.left = [[k.steps, k] for k in kills]

    async def turn(self, agent: RoleAgent, engine: InferenceEngine) -> None:
        await super().turn(agent, engine)
        for entry in self.left:
            kill = entry[1]
            if kill.role is None or agent.role is kill.role:
                entry[0] -= 1
            if entry[0] <= 0 and _claimed(kill.claim):
                os.kill(os.getpid(), signal.SIGKILL)
        self.left = [entry for entry in self.left if entry[0] > 0]


def _claimed(claim: Path | None) -> bool:
    if claim is None:
        return True
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def agent_stepping(name: str) -> KilledAfterSteps | None:
    """The stepping that kills the agent ``name`` as planned (None: no fault for it)."""
    kills = []
    for index, args in enumerate(planned("kill-agent")):
        if len(args) not in (2, 3) or args[0] not in (name, "*"):
            continue
        if args[0] == name and not first_start():
            continue
        claim = None
        if args[0] == "*":
            folder = os.environ.get(FAULT_DIR_ENV)
            if not folder:
                raise RuntimeError(f"{FAULT_ENV} kill-agent:*: needs {FAULT_DIR_ENV}")
            claim = Path(folder) / f"kill-agent-{index}"
        kills.append(Kill(int(args[1]), Role(args[2]) if len(args) == 3 else None, claim))
    return KilledAfterSteps(*kills) if kills else None


class JournalTrap:
    """A journal that calls ``spring(n)`` once, right before its n-th append since it was
    opened (``record``, 1-based): where a Controller dies mid-shift. Everything else is the
    journal's own. The test kit's in-process crash raises there, a real one SIGKILLs."""

    def __init__(self, inner: Journal, record: int, spring: Callable[[int], None]) -> None:
        self._inner = inner
        self._record: int | None = record
        self._spring = spring

    def append(self, record: Any, *, durable: bool = True) -> None:
        if self._inner.appended + 1 == self._record:
            self._record = None
            self._spring(self._inner.appended + 1)
        self._inner.append(record, durable=durable)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _kill_self(_: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crashing_journal(journal: Journal) -> Journal | JournalTrap:
    """``journal``, or a trap that kills the process as ``kill-controller`` plans."""
    start = start_count()
    for args in planned("kill-controller"):
        if start < len(args):
            return JournalTrap(journal, int(args[start]), _kill_self)
    return journal


def trainer_fault(point: str, version: int, rank: int) -> None:
    """Die here if ``PIVOT_FAULT`` plans it: ``point`` is ``crash-in-step`` or
    ``crash-in-checkpoint`` (see the module docstring)."""
    if not first_start():
        return
    for args in planned(point):
        if len(args) in (1, 2) and (int(args[0]), int(args[1]) if len(args) == 2 else 0) == (
            version,
            rank,
        ):
            if point == "crash-in-step":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(70)
