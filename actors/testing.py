"""pivot's test kit, shipped as ``trio.testing`` ships with trio and ``ray.cluster_utils`` with
Ray: what tests and users checking their own deployment both need.

* ``LocalCluster``: any deployment (``pivot.deployment``) assembled by the one builder
  (``pivot.actors.assembly``) on the local transport and the virtual clock, run to the end of
  its steps, with the invariants checked while it runs and faults injected from a plan.
* ``InvariantChecker``: every sequence owned once (queue, replica or done) and held by one
  agent; every device one role, the agents agreeing with the Controller's allocation and the
  schedulers routing to exactly its replicas; the trainer holding its pool exactly when the
  allocation gives it the pool.
* Test doubles for users' rollout functions (``pivot.actors.rollout_testing``): ``FakeLLM``
  and ``FakeJudge`` with scripted outputs, ``Abort`` and ``VersionBump`` scripted mid-call,
  ``run_rollout`` / ``run_rollouts`` (the function on the real Driver, schedulers and agents
  on a local cluster) and ``FakeContext`` (the same doubles in memory, no actors).
* ``FaultPlan``: crash the Controller right before its n-th journal record (a new one starts
  on the same journal after ``restart_after_s``); crash any in-process actor at a given time
  (``ActorCrash``); drop or delay requests by type and destination (``MessageFault``, on the
  ``FaultyTransport``).

Pure parts of the kit live beside what they test and are re-exported here: the scripted engine
(``pivot.engines.scripted.ScriptedEngine``), the engine conformance suite
(``pivot.engines.conformance``: ``EngineFactory``, ``check_engine``) and the cluster-snapshot
builders (``pivot.planning.scenarios``).

    LocalCluster(clock, deployment, *, backend, source, steps, driver=DriverOptions(),
                 control=None, faults=None, check="shift", watchers=())
        await .run(at_end=None) -> Assembly     the actors, stopped, after the last step
        .check()                     the invariants now (raises InvariantViolation)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import msgspec

from pivot.actors.assembly import (
    CONTROLLER,
    Assembly,
    Backend,
    Control,
    DriverOptions,
    assemble,
)
from pivot.actors.driver import StepReport
from pivot.actors.faults import JournalTrap
from pivot.actors.journal import Journal
from pivot.actors.rollout_testing import (
    Abort,
    FakeContext,
    FakeJudge,
    FakeLLM,
    Judgment,
    RolloutResult,
    ScriptError,
    Struck,
    VersionBump,
    make_task,
    run_rollout,
    run_rollouts,
)
from pivot.actors.sources import Source
from pivot.bus import Bus, LocalTransport, RequestTimeout, RestartPolicy, Supervisor
from pivot.bus.supervisor import ActorFactory
from pivot.cluster import Allocation, Role
from pivot.deployment import Deployment, Placement
from pivot.engines.conformance import ConformanceError, EngineFactory, check_engine
from pivot.engines.scripted import ScriptedEngine
from pivot.planning import scenarios
from pivot.planning.plans import Decision, DoneShift, HelperOffer, ShiftPolicy
from pivot.planning.routing import check_ownership
from pivot.planning.snapshot import ClusterSnapshot

__all__ = [
    "Abort",
    "FakeContext",
    "FakeJudge",
    "FakeLLM",
    "Judgment",
    "RolloutResult",
    "ScriptError",
    "Struck",
    "VersionBump",
    "make_task",
    "run_rollout",
    "run_rollouts",
    "ActorCrash",
    "ConformanceError",
    "EngineFactory",
    "ScriptedEngine",
    "check_engine",
    "scenarios",
    "FaultPlan",
    "FaultyTransport",
    "MessageFault",
    "InjectedCrash",
    "InvariantChecker",
    "InvariantViolation",
    "LocalCluster",
]


class InvariantViolation(AssertionError):
    """A deployment broke an invariant; the message says which and where."""


class InjectedCrash(RuntimeError):
    """The fault a ``FaultPlan`` injected."""


class MessageFault(msgspec.Struct, frozen=True, kw_only=True):
    """Drop or delay requests of type ``message`` (a class name) sent to ``to`` (None: any
    actor): the ``skip`` first matching ones pass, then ``count`` of them are hit. A dropped
    request never arrives (its sender times out, as over a lost connection); a delayed one
    arrives ``delay_s`` later on the cluster's clock."""

    message: str
    to: str | None = None
    action: Literal["drop", "delay"] = "drop"
    delay_s: float = 1.0
    skip: int = 0
    count: int = 1


class ActorCrash(msgspec.Struct, frozen=True, kw_only=True):
    """The in-process actor ``actor`` crashes at ``at_s`` on the cluster's clock (its
    supervisor then restarts it or stops the run, per its restart policy)."""

    actor: str
    at_s: float


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Faults to inject into a local cluster. ``crash_controller_before_record``: the first
    Controller dies right before writing that journal record (1-based); a new one, on the same
    journal, starts ``restart_after_s`` later and recovers. ``crashes``: actors that crash at
    a given time. ``messages``: requests dropped or delayed on the way."""

    crash_controller_before_record: int | None = None
    restart_after_s: float = 5.0
    crashes: tuple[ActorCrash, ...] = ()
    messages: tuple[MessageFault, ...] = ()


class FaultyTransport(LocalTransport):
    """The local transport with a plan's message faults; ``hits`` counts what each fault
    (by index in the plan) did."""

    def __init__(self, faults: Sequence[MessageFault]) -> None:
        super().__init__()
        self.faults = list(faults)
        self.hits = [0] * len(self.faults)
        self._seen = [0] * len(self.faults)
        self.decode: Callable[[bytes], Any] | None = None  # the bus codec's, once it exists

    async def request(self, to: str, frame: bytes, timeout: float) -> bytes:
        fault = self._match(to, frame)
        if fault is not None and fault.action == "drop":
            # never delivered: the sender waits out its timeout, as for a lost request
            await asyncio.sleep(timeout)
            raise RequestTimeout(to, timeout)
        if fault is not None:
            await asyncio.sleep(fault.delay_s)
        return await super().request(to, frame, timeout)

    def _match(self, to: str, frame: bytes) -> MessageFault | None:
        if not self.faults or self.decode is None:
            return None
        kind = type(self.decode(frame).body).__name__
        for i, fault in enumerate(self.faults):
            if fault.message != kind or (fault.to is not None and fault.to != to):
                continue
            self._seen[i] += 1
            if fault.skip < self._seen[i] <= fault.skip + fault.count:
                self.hits[i] += 1
                return fault
        return None


def _crash_controller(record: int) -> None:
    raise InjectedCrash(f"injected Controller crash before journal record {record}")


class InvariantChecker:
    """The invariants of one assembled deployment (see the module docstring)."""

    def __init__(self, assembly: Assembly) -> None:
        self.assembly = assembly
        self.checks = 0

    def check(self, *, settled: bool = True) -> None:
        """Every invariant; with ``settled`` False (a shift or a repair in flight, or the
        Controller recovering) only those about sequences."""
        self.checks += 1
        a = self.assembly
        # an agent that crashed and is not restarted yet, or that went silent and was taken
        # out: the Controller has given up on what it holds
        lost = set(a.controller.lost_devices) if a.controller is not None else set()
        agents = {d: agent for d, agent in a.agents.items() if agent.running and d not in lost}
        schedulers = a.schedulers
        for role, scheduler in schedulers.items():
            check_ownership(scheduler.core.ledger, scheduler.core)
            seen: dict[int, str] = {}
            for agent in agents.values():
                if agent.role is not role:
                    continue
                for seq_id in agent.held_sequences:
                    other = seen.setdefault(seq_id, agent.name)
                    if other != agent.name:
                        raise InvariantViolation(
                            f"{role.value} sequence {seq_id} runs on {other} and {agent.name}"
                        )
        if not settled:
            return
        deployment = a.deployment
        unmanaged = {d: p for d, p in deployment.placements.items() if d >= deployment.managed}
        controller = a.controller
        if controller is None or not controller.recovered.is_set():
            # before recovery the Controller's devices hold what they started with
            expected = dict(unmanaged) if controller is not None else dict(deployment.placements)
            self._check_devices(agents, expected)
            return
        allocation: Allocation = controller.allocation
        expected = dict(unmanaged)
        for replica in allocation.replicas.values():
            for d in replica.devices:
                expected[d] = Placement(replica.role, replica.id, replica.devices)
        for d in range(deployment.managed):
            expected.setdefault(d, Placement(Role.FREE, "", ()))
        self._check_devices(agents, expected)
        for role, scheduler in schedulers.items():
            routed = set(scheduler.routes)
            want = {r.id for r in allocation.of_role(role)}
            if routed != want:
                raise InvariantViolation(
                    f"{role.value} scheduler routes to {sorted(routed)}, the allocation has "
                    f"{sorted(want)}"
                )
            cut = set(scheduler.cut) - controller.helping  # (a gradient helper's is cut)
            if cut:
                raise InvariantViolation(f"{role.value} routing still cut from {sorted(cut)}")
        trainer = a.trainer
        if deployment.lent_pool and trainer is not None:
            holds = bool(allocation.of_role(Role.TRAINING))
            held = trainer.holds_pool  # type: ignore[attr-defined]
            if holds != held:
                raise InvariantViolation(
                    f"the allocation {'gives' if holds else 'lends'} the trainer pool but the "
                    f"trainer is {'awake' if held else 'offloaded'}"
                )

    @staticmethod
    def _check_devices(agents: Mapping[int, Any], expected: Mapping[int, Placement]) -> None:
        for d, agent in agents.items():
            want = expected.get(d, Placement(Role.FREE, "", ()))
            have = (agent.role, agent.replica or "", tuple(agent.devices))
            if have != (want.role, want.replica, tuple(want.devices)):
                raise InvariantViolation(
                    f"device {d}: agent holds {have[0].value} {have[1]!r} on {list(have[2])}, "
                    f"expected {want.role.value} {want.replica!r} on {list(want.devices)}"
                )


class _CheckedPolicy:
    """Wraps the Controller's planner (or stage policy): checks the invariants before a
    decision, when no shift is in flight and the allocation changed (or at every tick)."""

    def __init__(
        self,
        inner: ShiftPolicy,
        check: Callable[[], None],
        allocation: Callable[[], Allocation | None],
        every_tick: bool,
        settled: Callable[[], bool],
    ) -> None:
        self.inner = inner
        self.check = check
        self.allocation = allocation
        self.every_tick = every_tick
        self.settled = settled
        self._checked: Allocation | None = None

    def record_shift_time(self, seconds: float) -> None:
        self.inner.record_shift_time(seconds)

    def resume(self, done: Sequence[DoneShift]) -> None:
        self.inner.resume(done)

    def observe_decode(self, role: Role, running: int, tokens: int, itl_s: float) -> None:
        self.inner.observe_decode(role, running, tokens, itl_s)

    def helpers(self, snapshot: ClusterSnapshot, helping: Collection[str] = ()) -> HelperOffer:
        return self.inner.helpers(snapshot, helping)

    def decide(self, snapshot: ClusterSnapshot) -> Decision:
        current = self.allocation()
        if self.settled() and (self.every_tick or current is not self._checked):
            self.check()
            self._checked = current
        return self.inner.decide(snapshot)


class LocalCluster:
    """One deployment on the local transport and ``clock`` (a virtual clock; see
    ``pivot.bus.run_virtual``), checked as it runs: at every step end and whenever the
    allocation changed (``check="tick"``: at every Controller tick), and once more at the end.
    ``control.journal`` is opened afresh at each Controller (re)start; a ``FaultPlan``'s crash
    replaces the first one. With ``stall_s``, ``run`` fails (``InvariantViolation``) once that
    long passes on ``clock`` with no step ended."""

    def __init__(
        self,
        clock: Any,
        deployment: Deployment,
        *,
        backend: Backend,
        source: Source,
        steps: int,
        driver: DriverOptions | None = None,
        control: Control | None = None,
        faults: FaultPlan | None = None,
        check: Literal["shift", "tick"] = "shift",
        watchers: Sequence[tuple[str, ActorFactory]] = (),
        messages: Sequence[type] | None = None,
        stall_s: float | None = None,
    ) -> None:
        from pivot.actors.vocabulary import rl_messages

        self.clock = clock
        self.deployment = deployment
        self.stall_s = stall_s
        self.steps_ended = 0
        self.transport = FaultyTransport(faults.messages if faults is not None else ())
        self.bus = Bus.local(
            list(messages) if messages is not None else rl_messages(),
            transport=self.transport,
            clock=clock,
        )
        self.transport.decode = self.bus.codec.decode_request
        # agents restart (the supervisor's policy: ``restart_after_s`` after a crash); any
        # other actor that crashes stops the run (the Controller may restart, per its policy)
        restart_s = faults.restart_after_s if faults is not None else 5.0
        self.supervisor = Supervisor(
            clock=clock,
            policy=RestartPolicy(
                max_restarts=1_000, backoff=restart_s, backoff_factor=1.0, backoff_max=restart_s
            ),
        )
        self.journals: list[Journal] = []
        driver = driver or DriverOptions()
        user_step = driver.on_step

        def on_step(report: StepReport) -> None:
            self.steps_ended += 1
            if user_step is not None:
                user_step(report)
            self.check()

        if control is not None:
            control = self._checked_control(control, faults, every_tick=check == "tick")
        self.assembly = assemble(
            deployment,
            self.bus,
            self.supervisor,
            backend=backend,
            source=source,
            steps=steps,
            driver=dataclasses.replace(driver, on_step=on_step),
            control=control,
            watchers=watchers,
        )
        self.checker = InvariantChecker(self.assembly)
        self.crashes = faults.crashes if faults is not None else ()

    @property
    def checks(self) -> int:
        return self.checker.checks

    @property
    def restarts(self) -> int:
        """How often the Controller was restarted (after an injected crash)."""
        return self.supervisor.restarts(CONTROLLER)

    def check(self) -> None:
        """The invariants now: all of them when the Controller is settled, else those about
        sequences (raises InvariantViolation)."""
        self.checker.check(settled=self.settled)

    @property
    def settled(self) -> bool:
        """No shift in flight and no dead agent being taken out: when the invariants hold."""
        controller = self.assembly.controller
        return controller is None or controller.settled

    def _checked_control(
        self, control: Control, faults: FaultPlan | None, *, every_tick: bool
    ) -> Control:
        opened = control.journal
        crash = faults.crash_controller_before_record if faults is not None else None

        def journal() -> Journal:
            made = opened()
            first = not self.journals
            self.journals.append(made)
            if crash is not None and first:
                return JournalTrap(made, crash, _crash_controller)  # type: ignore[return-value]
            return made

        def wrap(policy: ShiftPolicy) -> ShiftPolicy:
            inner = control.wrap_policy(policy) if control.wrap_policy is not None else policy
            return _CheckedPolicy(
                inner, self.check, self._allocation, every_tick, lambda: self.settled
            )

        restart = control.restart
        crashes = faults is not None and (
            crash is not None or any(c.actor == CONTROLLER for c in faults.crashes)
        )
        if crashes:
            assert faults is not None
            restart = RestartPolicy(
                restart="on_failure",
                max_restarts=1_000_000,
                backoff=faults.restart_after_s,
                backoff_factor=1.0,
                backoff_max=faults.restart_after_s,
            )
        return dataclasses.replace(control, journal=journal, wrap_policy=wrap, restart=restart)

    async def _watch_progress(self, stall_s: float) -> None:
        """Raise once ``stall_s`` (clock) seconds pass with no step ended: a deployment that
        stopped making progress (every replica gone, a batch no replica can finish) would
        otherwise run on, its Controller ticking, forever."""
        seen = -1
        while seen != self.steps_ended:
            seen = self.steps_ended
            await self.clock.sleep(stall_s)
        raise InvariantViolation(
            f"no step ended in {stall_s:g} s ({seen} ended before): the deployment makes no "
            "progress"
        )

    def _crash(self, crash: ActorCrash) -> None:
        actor = self.assembly.actor(crash.actor)  # the instance running now
        if actor is None:
            return

        async def die() -> None:
            raise InjectedCrash(f"injected crash of {crash.actor!r} at {crash.at_s:g} s")

        actor.spawn(die(), name="injected-crash")

    def _allocation(self) -> Allocation | None:
        controller = self.assembly.controller
        return controller.allocation if controller is not None else None

    async def run(self, at_end: Callable[[], None] | None = None) -> Assembly:
        """Start every actor, run until the Driver's last step, check, call ``at_end`` (the
        actors still running, the clock where the last step left it), stop; the assembly
        keeps the stopped actors for reading their results."""
        sup, driver = self.supervisor, self.assembly.driver
        try:
            await sup.start()
            for crash in self.crashes:
                if self.assembly.actor(crash.actor) is None:
                    raise InvariantViolation(
                        f"no actor {crash.actor!r} runs in this process to crash"
                    )
                self.clock.call_later(crash.at_s - self.clock.now(), self._crash, crash)
            finished = asyncio.ensure_future(driver.finished.wait())
            failed = asyncio.ensure_future(sup.wait())
            stalled = None
            if self.stall_s is not None:
                stalled = asyncio.ensure_future(self._watch_progress(self.stall_s))
            watched = [f for f in (finished, failed, stalled) if f is not None]
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            for waiting in watched[1:]:
                waiting.cancel()  # (a task that ended stays done: its outcome is read below)
            if not finished.done():
                finished.cancel()
                for ended in watched[1:]:
                    if ended.done():
                        ended.result()  # raises the escalation (an actor crashed) or the stall
                raise InvariantViolation("every actor stopped before the Driver's last step")
            self.check()
            if at_end is not None:
                at_end()
            return self.assembly
        finally:
            await sup.stop()
            await self.bus.close()
            for journal in self.journals:
                journal.close()
