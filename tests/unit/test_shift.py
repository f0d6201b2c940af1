"""The shift transaction state machine, journal recovery and reconciliation (pure).

``World`` is a small model of what agents, schedulers and the trainer do with each command
(idempotently, as the actors do). The crash test kills the executor before every command
and between every pair of journal records, recovers from the journal and the world, and
checks that the result is a consistent allocation: the one before the shift or the one it
planned (less any given-up wake)."""

from __future__ import annotations

import msgspec
import pytest

from pivot.cluster import (
    Allocation,
    ClusterConfig,
    ClusterSpec,
    Move,
    Replica,
    ReplicaLayout,
    Role,
    RoleSpec,
)
from pivot.planning.plans import SequenceMigration, ShiftPlan
from pivot.shift import (
    AcquireDevice,
    AgentView,
    CutRoute,
    EvacuateReplica,
    JoinScheduler,
    LendPool,
    Phase,
    PhaseReached,
    Rebalance,
    ReclaimPool,
    ReleaseDevice,
    RestoreRoute,
    SchedulerView,
    ShiftError,
    ShiftPlanned,
    ShiftTransaction,
    allocation_problems,
    may_give_up,
    reconcile,
    recover,
    registers_on_acquire,
)

R, W = Role.ROLLOUT, Role.REWARD


def spec(reward_tp: int = 1, trainer_hosts: int = 0) -> ClusterSpec:
    return ClusterSpec.from_config(
        ClusterConfig(
            hosts=2,
            devices_per_host=2,
            trainer_hosts=trainer_hosts,
            rollout=RoleSpec(model="policy"),
            reward=RoleSpec(model="genrm", layout=ReplicaLayout(tp=reward_tp)),
        )
    )


def evict(replica: str, role: Role, *devices: int) -> Move:
    return Move("evict", replica, role, devices)


def wake(replica: str, role: Role, *devices: int) -> Move:
    return Move("wake", replica, role, devices)


SHIFT = ShiftPlan(
    kind="shift",
    receiver=W,
    moves=(
        evict("rollout@1", R, 1),
        evict("rollout@2", R, 2),
        wake("reward@1", W, 1),
        wake("reward@2", W, 2),
    ),
    migrations=(
        SequenceMigration(5, "rollout@1", None),
        SequenceMigration(9, "reward@3", "reward@1"),
        SequenceMigration(10, "reward@3", "reward@2"),
    ),
)


def drive(txn: ShiftTransaction, fail: set = frozenset(), give_up: bool = False) -> list:
    """Run every phase with all commands succeeding (except ``fail``); the records."""
    records = []
    while not txn.finished:
        for _ in range(3):
            for command in txn.pending():
                txn.confirm(command, command not in fail, give_up=give_up)
            if not txn.pending():
                break
        records.append(txn.advance(at=float(len(records))))
    return records


def test_phases_run_in_order_with_their_commands():
    txn, planned = ShiftTransaction.begin(7, SHIFT, at=1.0)
    assert planned == ShiftPlanned(txn=7, at=1.0, plan=SHIFT)
    seen = {}
    while not txn.finished:
        phase = txn.next_phase()
        seen[phase] = txn.pending()
        for command in seen[phase]:
            txn.confirm(command, True)
        record = txn.advance(at=2.0)
        assert record == PhaseReached(txn=7, phase=phase, at=2.0)
    assert list(seen) == [
        Phase.ROUTING_CUT,
        Phase.ABORTED,
        Phase.RELEASED,
        Phase.ACQUIRED,
        Phase.REGISTERED,
        Phase.DONE,
    ]
    assert seen[Phase.ROUTING_CUT] == [CutRoute(R, "rollout@1"), CutRoute(R, "rollout@2")]
    assert seen[Phase.ABORTED] == [
        EvacuateReplica(R, "rollout@1"),
        EvacuateReplica(R, "rollout@2"),
    ]
    assert seen[Phase.RELEASED] == [ReleaseDevice(1, "rollout@1"), ReleaseDevice(2, "rollout@2")]
    assert seen[Phase.ACQUIRED] == [
        AcquireDevice(1, W, "reward@1", (1,)),
        AcquireDevice(2, W, "reward@2", (2,)),
    ]
    assert seen[Phase.REGISTERED] == [
        JoinScheduler(1, W, "reward@1"),
        JoinScheduler(2, W, "reward@2"),
    ]
    # only the rebalancing moves, not the victims' requeues
    assert seen[Phase.DONE] == [Rebalance(W, SHIFT.migrations[1:])]
    assert txn.phase is Phase.DONE and txn.next_phase() is None and txn.pending() == []
    assert txn.applied_moves() == SHIFT.moves
    with pytest.raises(ShiftError, match="already done"):
        txn.advance(at=3.0)


def test_a_lone_victim_is_cut_by_its_abort():
    plan = ShiftPlan(
        kind="shift", receiver=W, moves=(evict("rollout@1", R, 1), wake("reward@1", W, 1))
    )
    txn, _ = ShiftTransaction.begin(1, plan, at=0.0)
    assert txn.pending() == []  # (RemoveReplica cuts routing before it evacuates)
    assert txn.advance(at=0.0).phase is Phase.ROUTING_CUT
    assert txn.pending() == [EvacuateReplica(R, "rollout@1")]
    # rolled back from there, its route is restored all the same (a no-op if never cut)
    assert recover([ShiftPlanned(txn=1, at=0.0, plan=plan)]).unfinished.rollback_commands() == [
        RestoreRoute(R, "rollout@1"),
        JoinScheduler(1, R, "rollout@1"),
    ]


def test_a_phase_is_not_entered_while_a_command_is_pending():
    txn, _ = ShiftTransaction.begin(1, SHIFT, at=0.0)
    first, second = txn.pending()
    txn.confirm(first, True)
    txn.confirm(second, False, give_up=True)  # a cut may not be given up
    assert txn.pending() == [second]
    with pytest.raises(ShiftError, match="1 commands pending"):
        txn.advance(at=0.0)
    txn.confirm(second, True)
    assert txn.advance(at=0.0).phase is Phase.ROUTING_CUT


def test_a_wake_that_keeps_failing_is_given_up_and_its_devices_released():
    txn, _ = ShiftTransaction.begin(1, SHIFT, at=0.0)
    bad = AcquireDevice(2, W, "reward@2", (2,))
    records = drive(txn, fail={bad}, give_up=True)
    assert txn.failed == {"reward@2"}
    assert records[3] == PhaseReached(txn=1, phase=Phase.ACQUIRED, at=3.0, failed=("reward@2",))
    # its Acquire may have registered it before its reply was lost: taken out, then released
    assert txn.commands(Phase.REGISTERED) == [
        JoinScheduler(1, W, "reward@1"),
        EvacuateReplica(W, "reward@2"),
        ReleaseDevice(2, "reward@2"),
    ]
    # the rebalance onto the failed replica is dropped
    assert txn.commands(Phase.DONE) == [Rebalance(W, (SHIFT.migrations[1],))]
    assert wake("reward@2", W, 2) not in txn.applied_moves()
    assert evict("rollout@2", R, 2) in txn.applied_moves()


def test_without_give_up_a_failing_wake_is_retried():
    txn, _ = ShiftTransaction.begin(1, SHIFT, at=0.0)
    for _ in (Phase.ROUTING_CUT, Phase.ABORTED, Phase.RELEASED):
        for command in txn.pending():
            txn.confirm(command, True)
        txn.advance(at=0.0)
    bad = AcquireDevice(2, W, "reward@2", (2,))
    for command in txn.pending():
        txn.confirm(command, command != bad)
    assert txn.pending() == [bad] and txn.failed == set()


def _acquired(txn: ShiftTransaction, registered: bool) -> None:
    """Take ``txn`` through its acquires, each reply saying ``registered``."""
    while txn.next_phase() is not Phase.ACQUIRED:
        for command in txn.pending():
            txn.confirm(command, True)
        txn.advance(at=0.0)
    for command in txn.pending():
        txn.confirm(command, True, registered=registered)
    txn.advance(at=0.0)


def test_a_one_device_wake_registered_on_acquire_sends_no_join():
    assert registers_on_acquire(AcquireDevice(1, W, "reward@1", (1,)))
    assert not registers_on_acquire(AcquireDevice(2, W, "reward@2", (2, 3)))
    assert not registers_on_acquire(AcquireDevice(3, W, "reward@2", (2, 3)))
    assert not registers_on_acquire(AcquireDevice(2, Role.TRAINING, "trainer", (2,)))
    txn, _ = ShiftTransaction.begin(1, SHIFT, at=0.0)
    _acquired(txn, registered=True)
    assert txn.pending() == []
    # a registration that failed on acquire (its reply not serving) joins as before
    txn, _ = ShiftTransaction.begin(1, SHIFT, at=0.0)
    _acquired(txn, registered=False)
    assert txn.pending() == [JoinScheduler(1, W, "reward@1"), JoinScheduler(2, W, "reward@2")]


def test_a_multi_device_wake_joins_after_every_acquire():
    plan = ShiftPlan(
        kind="shift",
        receiver=W,
        moves=(evict("rollout@2", R, 2, 3), wake("reward@2", W, 2, 3)),
    )
    txn, _ = ShiftTransaction.begin(1, plan, at=0.0)
    _acquired(txn, registered=True)  # (its leader was not asked to register)
    assert txn.pending() == [JoinScheduler(2, W, "reward@2")]


def test_a_recovered_shift_registers_its_wakes_again():
    txn, planned = ShiftTransaction.begin(1, SHIFT, at=0.0)
    records = [planned]
    while txn.next_phase() is not Phase.REGISTERED:
        for command in txn.pending():
            txn.confirm(command, True, registered=True)
        records.append(txn.advance(at=0.0))
    assert txn.pending() == []
    restarted = recover(records).unfinished
    assert restarted.phase is Phase.ACQUIRED
    assert restarted.pending() == [
        JoinScheduler(1, W, "reward@1"),
        JoinScheduler(2, W, "reward@2"),
    ]


def test_which_commands_may_be_given_up():
    assert may_give_up(AcquireDevice(1, W, "x", (1,)))
    assert may_give_up(JoinScheduler(1, W, "x"))
    assert may_give_up(Rebalance(W, ()))
    assert not may_give_up(AcquireDevice(2, Role.TRAINING, "trainer", (2, 3)))
    for command in (CutRoute(R, "x"), EvacuateReplica(R, "x"), ReleaseDevice(1, "x")):
        assert not may_give_up(command)
    assert not may_give_up(LendPool((2, 3))) and not may_give_up(ReclaimPool((2, 3)))


def test_lending_and_reclaiming_the_trainer_pool():
    lend = ShiftPlan(
        kind="lend_trainer", receiver=Role.FREE, moves=(evict("trainer", Role.TRAINING, 2, 3),)
    )
    txn, _ = ShiftTransaction.begin(1, lend, at=0.0)
    assert txn.commands(Phase.ROUTING_CUT) == [] and txn.commands(Phase.ABORTED) == []
    assert txn.commands(Phase.RELEASED) == [
        ReleaseDevice(2, "trainer"),
        ReleaseDevice(3, "trainer"),
        LendPool((2, 3)),
    ]
    reclaim = ShiftPlan(
        kind="reclaim_trainer",
        receiver=Role.TRAINING,
        moves=(evict("reward@2", W, 2, 3), wake("trainer", Role.TRAINING, 2, 3)),
    )
    txn, _ = ShiftTransaction.begin(2, reclaim, at=0.0)
    assert txn.commands(Phase.ACQUIRED) == [
        AcquireDevice(2, Role.TRAINING, "trainer", (2, 3)),
        AcquireDevice(3, Role.TRAINING, "trainer", (2, 3)),
        ReclaimPool((2, 3)),
    ]
    assert txn.commands(Phase.REGISTERED) == []  # training registers with no scheduler


def test_an_empty_plan_is_refused():
    with pytest.raises(ShiftError, match="moves nothing"):
        ShiftTransaction.begin(1, ShiftPlan(kind="shift", receiver=W, moves=()), at=0.0)


# --- recovery from the journal ----------------------------------------------------------------


def _journal(upto: int) -> list:
    txn, planned = ShiftTransaction.begin(3, SHIFT, at=0.0)
    return [planned, *drive(txn)][:upto]


@pytest.mark.parametrize("upto", range(1, 8))
def test_recover_rebuilds_the_open_shift_at_its_last_phase(upto):
    state = recover(_journal(upto))
    assert state.next_txn == 4 and state.problems == []
    if upto == 7:
        assert state.unfinished is None
        return
    txn = state.unfinished
    assert txn.txn == 3 and txn.plan == SHIFT
    assert txn.phase is (Phase.PLANNED, *[r.phase for r in _journal(7)[1:]])[upto - 1]
    assert txn.rolls_back == (upto <= 2)


def test_recover_keeps_the_failed_wakes():
    txn, planned = ShiftTransaction.begin(1, SHIFT, at=0.0)
    records = [planned, *drive(txn, fail={AcquireDevice(1, W, "reward@1", (1,))}, give_up=True)]
    state = recover(records[:5])  # up to acquired
    assert state.unfinished.phase is Phase.ACQUIRED and state.unfinished.failed == {"reward@1"}


def test_rollback_restores_routes_and_registrations():
    state = recover(_journal(2))
    txn = state.unfinished
    assert txn.rollback_commands() == [
        RestoreRoute(R, "rollout@1"),
        JoinScheduler(1, R, "rollout@1"),
        RestoreRoute(R, "rollout@2"),
        JoinScheduler(2, R, "rollout@2"),
    ]
    assert txn.rolled_back(at=9.0) == PhaseReached(txn=3, phase=Phase.ROLLED_BACK, at=9.0)
    assert txn.finished and txn.applied_moves() == ()
    assert (
        recover([*_journal(2), PhaseReached(txn=3, phase=Phase.ROLLED_BACK, at=9.0)]).unfinished
        is None
    )
    forward = recover(_journal(3)).unfinished
    with pytest.raises(ShiftError, match="rolled forward"):
        forward.rollback_commands()


def test_recover_reports_a_journal_that_contradicts_itself():
    records = _journal(3)
    state = recover([records[0], records[2], PhaseReached(txn=99, phase=Phase.DONE, at=0.0)])
    assert state.unfinished.phase is Phase.PLANNED
    assert len(state.problems) == 2
    assert "expected routing_cut" in state.problems[0] and "unknown shift 99" in state.problems[1]


# --- reconciliation ----------------------------------------------------------------------------


def views(
    holdings: dict[int, tuple[Role, str | None, tuple[int, ...]]], unreachable=()
) -> list[AgentView]:
    out = []
    for device in range(4):
        role, replica, devices = holdings.get(device, (Role.FREE, None, ()))
        out.append(
            AgentView(
                device=device,
                agent=f"agent-{device}",
                role=role,
                replica=replica,
                devices=devices,
                reachable=device not in unreachable,
            )
        )
    return out


def sched(role: Role, *replicas: str, cut=()) -> SchedulerView:
    return SchedulerView(
        role=role,
        replicas={r: f"agent-{r.rsplit('@', 1)[1]}" for r in replicas},
        cut=frozenset(cut),
    )


CONSISTENT = {
    0: (R, "rollout@0", (0,)),
    1: (R, "rollout@1", (1,)),
    2: (W, "reward@2", (2,)),
    3: (W, "reward@3", (3,)),
}


def test_a_consistent_cluster_needs_nothing():
    result = reconcile(
        spec(),
        views(CONSISTENT),
        {R: sched(R, "rollout@0", "rollout@1"), W: sched(W, "reward@2", "reward@3")},
    )
    assert result.stages == [] and result.problems == []
    assert sorted(r.id for r in result.replicas) == [
        "reward@2",
        "reward@3",
        "rollout@0",
        "rollout@1",
    ]


def test_reconcile_fixes_what_disagrees():
    holdings = dict(CONSISTENT)
    holdings[1] = (Role.FREE, None, ())  # released, but the scheduler still routes to it
    result = reconcile(
        spec(),
        views(holdings),
        {R: sched(R, "rollout@0", "rollout@1", cut=["rollout@0"]), W: sched(W, "reward@2")},
    )
    evacuate, fix = result.stages
    assert evacuate == [EvacuateReplica(R, "rollout@1")]
    assert set(fix) == {RestoreRoute(R, "rollout@0"), JoinScheduler(3, W, "reward@3")}
    assert len(result.problems) == 3


def test_reconcile_releases_a_half_acquired_multi_device_replica():
    holdings = {
        0: (W, "reward@0", (0, 1)),  # device 1's agent never took its part
        2: (W, "reward@2", (2, 3)),
        3: (W, "reward@2", (2, 3)),
    }
    result = reconcile(spec(reward_tp=2), views(holdings), {R: sched(R), W: sched(W, "reward@2")})
    assert result.stages == [[ReleaseDevice(0, "reward@0")]]
    assert [r.id for r in result.replicas] == ["reward@2"]


def test_reconcile_forces_the_removal_of_a_replica_whose_agent_is_gone():
    result = reconcile(
        spec(),
        views(CONSISTENT, unreachable={1}),
        {R: sched(R, "rollout@0", "rollout@1"), W: sched(W, "reward@2", "reward@3")},
    )
    assert result.stages == [[EvacuateReplica(R, "rollout@1", force=True)]]


@pytest.mark.parametrize(
    ("now", "registered", "force"),
    [(7, 7, False), (8, 7, True), (0, 7, False), (8, 0, False)],
    ids=["released", "restarted", "agent-silent", "scheduler-silent"],
)
def test_reconcile_forces_the_removal_of_a_replica_whose_agent_restarted(now, registered, force):
    # device 1's agent is reachable and free; the scheduler routes to the replica that agent
    # registered: forced only when the agent answering now is another instance than that one
    agents = [
        msgspec.structs.replace(v, incarnation=now) if v.device == 1 else v
        for v in views(CONSISTENT | {1: (Role.FREE, None, ())})
    ]
    rollout = msgspec.structs.replace(
        sched(R, "rollout@0", "rollout@1"), agent_incarnations={"rollout@1": registered}
    )
    result = reconcile(spec(), agents, {R: rollout, W: sched(W, "reward@2", "reward@3")})
    assert result.stages[0] == [EvacuateReplica(R, "rollout@1", force=force)]
    assert ("restarted" in result.problems[0]) is force


@pytest.mark.parametrize(
    ("pool_role", "trainer_holds", "fix"),
    [
        (Role.TRAINING, False, ReclaimPool((2, 3))),
        (Role.FREE, True, LendPool((2, 3))),
    ],
)
def test_reconcile_makes_the_trainer_agree_with_its_pool(pool_role, trainer_holds, fix):
    replica = "trainer" if pool_role is Role.TRAINING else None
    devices = (2, 3) if replica else ()
    holdings = {0: (R, "rollout@0", (0,)), 1: (W, "reward@1", (1,))}
    holdings |= {2: (pool_role, replica, devices), 3: (pool_role, replica, devices)}
    schedulers = {R: sched(R, "rollout@0"), W: sched(W, "reward@1")}
    result = reconcile(spec(trainer_hosts=1), views(holdings), schedulers, trainer_holds)
    assert result.stages == [[fix]]
    assert (
        reconcile(spec(trainer_hosts=1), views(holdings), schedulers, not trainer_holds).stages
        == []
    )


def test_a_pool_agent_restarted_while_the_trainer_trains_takes_the_training_role_again():
    # device 3's agent restarted free while the trainer held its pool: it rejoins the
    # training replica; the trainer is not made to lend its pool
    holdings = {0: (R, "rollout@0", (0,)), 1: (W, "reward@1", (1,))}
    holdings |= {2: (Role.TRAINING, "trainer", (2, 3)), 3: (Role.FREE, None, ())}
    schedulers = {R: sched(R, "rollout@0"), W: sched(W, "reward@1")}
    result = reconcile(spec(trainer_hosts=1), views(holdings), schedulers, True)
    assert result.stages == [[AcquireDevice(3, Role.TRAINING, "trainer", (2, 3))]]
    assert "trainer" in {r.id for r in result.replicas}
    # with the trainer offloaded the half-held replica is broken: released, as before
    offloaded = reconcile(spec(trainer_hosts=1), views(holdings), schedulers, False)
    assert offloaded.stages == [[ReleaseDevice(2, "trainer")]]


# --- crash anywhere, recover, consistent ---------------------------------------------------------


class Crash(Exception):
    pass


class World:
    """What agents, schedulers and the trainer hold, changed by commands as the actors do."""

    def __init__(self, spec: ClusterSpec, replicas: list[Replica], trainer_holds: bool) -> None:
        self.spec = spec
        self.agents: dict[int, tuple[Role, str | None, tuple[int, ...]]] = {
            d.id: (Role.FREE, None, ()) for d in spec.devices
        }
        self.routes: dict[Role, dict[str, str]] = {R: {}, W: {}}
        self.cut: dict[Role, set[str]] = {R: set(), W: set()}
        self.trainer_holds = trainer_holds
        for replica in replicas:
            for device in replica.devices:
                self.agents[device] = (replica.role, replica.id, replica.devices)
            if replica.role in (R, W):
                self.routes[replica.role][replica.id] = f"agent-{replica.devices[0]}"

    def apply(self, command) -> bool:
        match command:
            case CutRoute(role, replica):
                if replica in self.routes[role]:
                    self.cut[role].add(replica)
            case RestoreRoute(role, replica):
                self.cut[role].discard(replica)
            case EvacuateReplica(role, replica, _):
                self.routes[role].pop(replica, None)
                self.cut[role].discard(replica)
            case ReleaseDevice(device, replica):
                if self.agents[device][1] == replica:
                    self.agents[device] = (Role.FREE, None, ())
            case AcquireDevice(device, role, replica, devices):
                held = self.agents[device]
                if held[:2] == (role, replica):
                    return True
                if held[0] is not Role.FREE:
                    return False
                self.agents[device] = (role, replica, devices)
            case JoinScheduler(device, role, replica):
                held = self.agents[device]
                if held[:2] != (role, replica) or held[2][0] != device:
                    return False
                self.routes[role][replica] = f"agent-{device}"
            case LendPool():
                self.trainer_holds = False
            case ReclaimPool():
                self.trainer_holds = True
            case Rebalance():
                pass
        return True

    def views(self) -> tuple[list[AgentView], dict[Role, SchedulerView]]:
        agents = [
            AgentView(device=d, agent=f"agent-{d}", role=r, replica=i, devices=ds)
            for d, (r, i, ds) in sorted(self.agents.items())
        ]
        schedulers = {
            role: SchedulerView(
                role=role, replicas=dict(self.routes[role]), cut=frozenset(self.cut[role])
            )
            for role in (R, W)
        }
        return agents, schedulers

    def replicas(self) -> set[tuple[str, Role, tuple[int, ...]]]:
        return {(i, r, ds) for r, i, ds in self.agents.values() if i is not None}


def execute(
    txn: ShiftTransaction, world: World, journal: list, budget: list[int], refuse=()
) -> None:
    """The Controller's loop, one command at a time; raises Crash when ``budget`` runs out."""

    def send(command) -> bool:
        if budget[0] == 0:
            raise Crash
        budget[0] -= 1
        return command not in refuse and world.apply(command)

    def write(record) -> None:
        if budget[0] == 0:
            raise Crash
        budget[0] -= 1
        journal.append(record)

    while not txn.finished:
        attempt = 0
        while pending := txn.pending():
            attempt += 1
            assert attempt < 10, f"stuck: {pending}"
            for command in pending:
                txn.confirm(command, send(command), give_up=attempt >= 3)
        write(txn.advance(at=0.0))


def recover_world(world: World, journal: list, refuse=()) -> None:
    """Controller restart: finish (or undo) the journal's open shift."""
    state = recover(journal)
    assert state.problems == []
    txn = state.unfinished
    if txn is not None:
        if txn.rolls_back:
            for command in txn.rollback_commands():
                world.apply(command)
            journal.append(txn.rolled_back(at=0.0))
        else:
            execute(txn, world, journal, [10**6], refuse)
    agents, schedulers = world.views()
    # the journal alone brings the world back: reconciliation finds nothing left to do
    assert reconcile(world.spec, agents, schedulers, world.trainer_holds).stages == []


CRASH_CASES = [
    (
        "shift",
        spec(),
        [
            Replica("rollout@0", R, (0,)),
            Replica("rollout@1", R, (1,)),
            Replica("rollout@2", R, (2,)),
            Replica("reward@3", W, (3,)),
        ],
        SHIFT,
        True,
        (),
    ),
    (
        "multi-device wake, one failing",
        spec(reward_tp=2),
        [
            Replica("rollout@0", R, (0,)),
            Replica("rollout@1", R, (1,)),
            Replica("rollout@2", R, (2,)),
            Replica("rollout@3", R, (3,)),
        ],
        ShiftPlan(
            kind="shift",
            receiver=W,
            moves=(
                evict("rollout@0", R, 0),
                evict("rollout@1", R, 1),
                evict("rollout@2", R, 2),
                evict("rollout@3", R, 3),
                wake("reward@0", W, 0, 1),
                wake("reward@2", W, 2, 3),
            ),
        ),
        True,
        (AcquireDevice(3, W, "reward@2", (2, 3)),),
    ),
    (
        "lend",
        spec(trainer_hosts=1),
        [
            Replica("rollout@0", R, (0,)),
            Replica("reward@1", W, (1,)),
            Replica("trainer", Role.TRAINING, (2, 3)),
        ],
        ShiftPlan(
            kind="lend_trainer", receiver=Role.FREE, moves=(evict("trainer", Role.TRAINING, 2, 3),)
        ),
        True,
        (),
    ),
    (
        "reclaim",
        spec(trainer_hosts=1),
        [
            Replica("rollout@0", R, (0,)),
            Replica("reward@1", W, (1,)),
            Replica("reward@2", W, (2,)),
            Replica("rollout@3", R, (3,)),
        ],
        ShiftPlan(
            kind="reclaim_trainer",
            receiver=Role.TRAINING,
            moves=(
                evict("reward@2", W, 2),
                evict("rollout@3", R, 3),
                wake("trainer", Role.TRAINING, 2, 3),
            ),
        ),
        False,
        (),
    ),
]


def _steps(case) -> int:
    """How many commands and records the shift takes without a crash."""
    _, spec_, replicas, plan, holds, refuse = case
    world = World(spec_, replicas, holds)
    budget = [10**6]
    txn, planned = ShiftTransaction.begin(1, plan, at=0.0)
    journal = [planned]
    execute(txn, world, journal, budget, refuse)
    return 10**6 - budget[0]


@pytest.mark.parametrize("case", CRASH_CASES, ids=[c[0] for c in CRASH_CASES])
def test_a_crash_anywhere_recovers_to_a_consistent_allocation(case):
    _, spec_, replicas, plan, holds, refuse = case
    before = {(r.id, r.role, r.devices) for r in replicas}
    total = _steps(case)
    outcomes = set()
    for crash_at in range(total + 1):
        world = World(spec_, replicas, holds)
        txn, planned = ShiftTransaction.begin(1, plan, at=0.0)
        journal = [planned]  # written before the first command
        try:
            execute(txn, world, journal, [crash_at], refuse)
        except Crash:
            pass
        recover_world(world, journal, refuse)
        agents, schedulers = world.views()
        assert allocation_problems(spec_, agents, schedulers, world.trainer_holds) == [], crash_at
        after = world.replicas()
        Allocation(spec_, [Replica(*r) for r in after])  # every device one role, sizes right
        expected = Allocation(spec_, replicas).apply(
            m
            for m in plan.moves
            if not (m.kind == "wake" and any(c.replica == m.replica_id for c in refuse))
        )
        planned_after = {(r.id, r.role, r.devices) for r in expected.replicas.values()}
        assert after in (before, planned_after), crash_at
        outcomes.add("forward" if after == planned_after else "back")
    assert outcomes == {"forward", "back"}


def test_recover_lists_the_shifts_done_for_a_restarted_planner():
    from pivot.planning.cost import CostModel
    from pivot.planning.planner import Planner, PlannerSettings
    from pivot.planning.plans import DoneShift

    first, p1 = ShiftTransaction.begin(1, SHIFT, at=10.0)
    lend_plan = ShiftPlan(
        kind="lend_trainer", receiver=Role.FREE, moves=(evict("trainer", Role.TRAINING, 2, 3),)
    )
    second, p2 = ShiftTransaction.begin(2, lend_plan, at=20.0)
    third, p3 = ShiftTransaction.begin(3, SHIFT, at=30.0)
    # drive() stamps each phase with its index: shifts 1 and 2 end at 5.0; 3 is left open
    records = [p1, *drive(first), p2, *drive(second), p3, *drive(third)[:3]]
    state = recover(records)
    assert state.unfinished.txn == 3 and state.problems == []
    assert state.done == [DoneShift("shift", 10.0, 5.0), DoneShift("lend_trainer", 20.0, 5.0)]

    done = [DoneShift("shift", 0.0, 2.0), DoneShift("lend_trainer", 3.0, 4.0)]
    settings = PlannerSettings(migrate_time_init_s=1.0, migrate_time_alpha=0.5)
    model = CostModel(a=1e-7, b=1e-3, c=1e-5, d=1e-3)
    planner = Planner(spec(), {Role.ROLLOUT: model, Role.REWARD: model}, settings)
    planner.resume(done)
    # the average folds 2.0 then 1.0 into 1.0; the cooldown runs from the last role shift
    assert planner.migrate_time_s == pytest.approx(0.5 * (0.5 * 1.0 + 0.5 * 2.0) + 0.5 * 1.0)
    assert planner.last_action_at == 0.0
