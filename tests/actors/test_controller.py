"""The Controller shifting devices between roles through real actors (schedulers, agents, a
fake trainer) on the local transport and the virtual clock: deterministic, no threads.

Engines are scripted: a sequence's output depends only on its seed and length, so a sequence
that was aborted on one replica and re-dispatched to another must end with exactly the tokens
it would have produced without the shift; every sequence must complete exactly once."""

from __future__ import annotations

import asyncio
import io
import itertools
import json

import msgspec
import pytest

from pivot.actors.agent import Inline, RoleAgent, WeightLoader
from pivot.actors.controller import (
    Controller,
    ControllerSettings,
    decision_kind,
    open_journal,
)
from pivot.actors.journal import Journal
from pivot.actors.messages import (
    Ack,
    Assign,
    Completed,
    Completion,
    RegisterReplica,
    SubmitSequences,
    Work,
)
from pivot.actors.scheduler import Scheduler
from pivot.actors.shift_messages import (
    Acquire,
    AgentState,
    AllocationChanged,
    AllocationReport,
    CutRouting,
    Describe,
    MigrateSequences,
    PlannerDecided,
    QueryAllocation,
    Register,
    Release,
    RemoveReplica,
    ReplicaRemoved,
    RestoreRouting,
    ShiftFinished,
    ShiftStarted,
    TrainerPhaseChanged,
)
from pivot.actors.trainer_messages import (
    Helping,
    HelpTrainer,
    OffloadTrainer,
    QueryTrainer,
    ReloadTrainer,
    TrainerStatus,
)
from pivot.actors.vocabulary import rl_messages
from pivot.bus import (
    Actor,
    Bus,
    LocalTransport,
    RemoteError,
    configure_logging,
    handles,
    run_virtual,
)
from pivot.cluster import ClusterConfig, ClusterSpec, Move, ReplicaLayout, Role, RoleSpec
from pivot.engines.protocol import ContextKind, SamplingParams
from pivot.engines.scripted import ScriptedEngine
from pivot.planning.cost import CostModel
from pivot.planning.planner import Planner, PlannerSettings
from pivot.planning.plans import SequenceMigration, ShiftPlan
from pivot.planning.queue import Sequence
from pivot.planning.routing import RouterSettings, check_ownership, make_router
from pivot.shift import FORWARD, AgentView, SchedulerView, ShiftRecord, allocation_problems

MODEL = CostModel(a=1e-5, b=0.01, c=1e-3, d=0.005)
ROUTER = RouterSettings(policy="lowest_itl", max_concurrent_per_replica=8)
SETTINGS = ControllerSettings(
    interval_s=0.5,
    command_timeout_s=5.0,
    retry_backoff_s=0.2,
    planner=PlannerSettings(
        min_awake_per_role=1, cooldown_s=2.0, immunity_s=2.0, migrate_time_init_s=0.05
    ),
)


def script(seed: int, length: int) -> list[int]:
    return [(seed * 7 + i) % 50 + 1 for i in range(length)]


PREFILL_S = 0.001


def scripted_engine() -> ScriptedEngine:
    """One token per step for each running sequence, following ``script(seed, length)``; a
    step's latency is the cost model's ITL, its prefill a made-up PREFILL_S per sequence."""
    return ScriptedEngine(
        lambda prompt, sampling: script(sampling.seed, sampling.max_new_tokens),
        max_running=8,
        cost_model=MODEL,
        prefill_s=PREFILL_S,
    )


def no_weights(model: str, min_version: int) -> tuple[dict, int]:
    """A scripted engine's weights are its script: nothing to read (as the simulation's
    loaders), but resumed weights serve only once loaded, as on any engine."""
    return {}, min_version


class Sink(Actor):
    """The next stage of both roles: keeps every completion it is handed."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.got: dict[str, list[Completion]] = {"rollout": [], "reward": []}

    @handles
    def completed(self, msg: Completed) -> Ack:
        self.got[msg.role].extend(msg.completions)
        return Ack(count=len(msg.completions))


class FakeTrainer(Actor):
    """The trainer as the Controller sees it: idle, training or offloaded (pool lent)."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.state = "idle"
        self.calls: list[str] = []
        self.holds_pool = True
        self.takes: set[str] | None = None  # the helpers a step takes (None: takes none)
        self.offered: list[str] = []

    def lend(self) -> None:
        self.state, self.holds_pool = "offloaded", False

    def _status(self) -> TrainerStatus:
        return TrainerStatus(
            name=self.name,
            state=self.state,
            version=0,
            world_size=1,
            zero_stage=0,
            steps=0,
            store=None,
            holds_pool=self.holds_pool,
            takes_helpers=self.takes is not None,
        )

    @handles
    def help(self, msg: HelpTrainer) -> Helping:
        self.offered += [h.replica for h in msg.helpers]
        taken = [h.replica for h in msg.helpers if h.replica in (self.takes or ())]
        return Helping(replicas=taken, version=1)

    @handles
    def query(self, msg: QueryTrainer) -> TrainerStatus:
        return self._status()

    @handles
    def offload(self, msg: OffloadTrainer) -> TrainerStatus:
        self.calls.append("offload")
        self.lend()
        return self._status()

    @handles
    def reload(self, msg: ReloadTrainer) -> TrainerStatus:
        self.calls.append("reload")
        self.holds_pool = True
        if self.state == "offloaded":
            self.state = "idle"
        return self._status()


class Monitor(Actor):
    """Collects the Controller's events."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.events: list = []

    async def run(self) -> None:
        async for pub in self.subscribe("shift"):
            self.events.append(pub.message)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


class Killed(Exception):
    """The test killing the Controller."""


class CrashingJournal(Journal):
    """Kills the Controller right before (or right after) its n-th append."""

    def __init__(self, path, *, before: int | None = None, after: int | None = None) -> None:
        super().__init__(path, type_=ShiftRecord, fsync=False)
        self.before, self.after = before, after

    def append(self, record, *, durable: bool = True) -> None:
        if self.before == self.appended + 1:
            raise Killed(f"before record {self.before}")
        super().append(record, durable=durable)
        if self.after == self.appended:
            raise Killed(f"after record {self.after}")


def four_devices() -> ClusterSpec:
    return ClusterSpec.from_config(
        ClusterConfig(
            hosts=1,
            devices_per_host=4,
            rollout=RoleSpec(model="policy"),
            reward=RoleSpec(model="genrm"),
        )
    )


def trainer_cluster() -> ClusterSpec:
    return ClusterSpec.from_config(
        ClusterConfig(
            hosts=2,
            devices_per_host=2,
            trainer_hosts=1,
            rollout=RoleSpec(model="policy"),
            reward=RoleSpec(model="genrm"),
        )
    )


SCHEDULERS = {Role.ROLLOUT: "rollout-sched", Role.REWARD: "reward-sched"}


class Cluster:
    """Schedulers, one agent per device (both engines each), a sink, maybe a trainer."""

    def __init__(
        self,
        clock,
        spec: ClusterSpec,
        layout: dict[int, tuple[str, str, tuple[int, ...]]],
        *,
        trainer: bool = False,
    ) -> None:
        self.clock = clock
        self.spec = spec
        self.bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        self.sink = Sink("sink", self.bus)
        self.trainer = FakeTrainer("trainer", self.bus) if trainer else None
        self.monitor = Monitor("monitor", self.bus)
        self.schedulers = {
            role: Scheduler(
                name,
                self.bus,
                role=role,
                router=make_router(ROUTER, MODEL),
                downstream="sink",
                request_timeout=5.0,
            )
            for role, name in SCHEDULERS.items()
        }
        self.engines: dict[int, dict[str, ScriptedEngine]] = {}
        self.agents: dict[int, RoleAgent] = {}
        for device in range(spec.size):
            role, replica, devices = layout.get(device, ("free", "", ()))
            engines = {"rollout": scripted_engine(), "reward": scripted_engine()}
            self.engines[device] = engines
            self.agents[device] = RoleAgent(
                f"agent-{device}",
                self.bus,
                role=role,
                replica=replica or None,
                devices=devices or None,
                device=device,
                engines=engines,
                weights={"rollout": no_weights, "reward": no_weights},
                scheduler=SCHEDULERS.get(Role(role)),
                stepping=Inline(pace=True),
                report_timeout=5.0,
            )
        self.submitted: dict[str, dict[int, Work]] = {"rollout": {}, "reward": {}}
        self.controller: Controller | None = None

    def make_controller(self, journal: Journal) -> Controller:
        return Controller("controller", self.bus, **self.controller_kwargs(journal))

    def controller_kwargs(self, journal: Journal) -> dict:
        return dict(
            spec=self.spec,
            agents={d: a.name for d, a in self.agents.items()},
            schedulers=SCHEDULERS,
            journal=journal,
            policy=Planner(
                self.spec,
                {Role.ROLLOUT: MODEL, Role.REWARD: MODEL},
                SETTINGS.planner,
                {Role.ROLLOUT: ROUTER, Role.REWARD: ROUTER},
            ),
            models={Role.ROLLOUT: "policy", Role.REWARD: "genrm"},
            trainer="trainer" if self.trainer else None,
            settings=SETTINGS,
        )

    async def start(self) -> None:
        extra = [self.trainer] if self.trainer else []
        for actor in (self.sink, self.monitor, *extra, *self.schedulers.values()):
            await actor.start()
        for agent in self.agents.values():
            await agent.start()
        self.client = Actor("client", self.bus)
        await self.client.start()

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        await self.client.stop()
        for agent in self.agents.values():
            await agent.stop()
        extra = [self.trainer] if self.trainer else []
        for actor in (*self.schedulers.values(), *extra, self.monitor, self.sink):
            await actor.stop()

    async def run_controller(self, journal: Journal) -> Controller:
        self.controller = self.make_controller(journal)
        await self.controller.start()
        return self.controller

    async def submit(self, role: str, first_id: int, count: int, length: int) -> None:
        works = [
            Work(
                seq_id=i,
                prompt_ids=[1] * 10,
                sampling=SamplingParams(max_new_tokens=length, seed=i),
            )
            for i in range(first_id, first_id + count)
        ]
        self.submitted[role].update((w.seq_id, w) for w in works)
        await self.client.request(SCHEDULERS[Role(role)], SubmitSequences(sequences=works))

    async def until(self, condition, what: str, limit_s: float = 300.0) -> None:
        deadline = self.clock.now() + limit_s
        while not condition():
            if self.clock.now() > deadline:
                raise AssertionError(f"{what}: not within {limit_s} virtual seconds")
            await self.clock.sleep(0.05)

    def all_done(self) -> bool:
        return all(len(self.sink.got[r]) >= len(self.submitted[r]) for r in self.submitted)

    async def until_done(self) -> None:
        await self.until(self.all_done, "every sequence completed")

    async def finish(self) -> None:
        """Every sequence completed exactly once with its scripted tokens; then stop."""
        await self.until_done()
        self.check_outputs()
        await self.stop()

    # --- invariants -------------------------------------------------------------------------

    def agent_views(self) -> list[AgentView]:
        views = []
        for device, agent in self.agents.items():
            s = agent.state()
            views.append(
                AgentView(
                    device=device,
                    agent=agent.name,
                    role=s.role,
                    replica=s.replica,
                    devices=tuple(s.devices),
                    running=tuple(s.running),
                )
            )
        return views

    def scheduler_views(self) -> dict[Role, SchedulerView]:
        return {
            role: SchedulerView(role=role, replicas=s.routes, cut=s.cut)
            for role, s in self.schedulers.items()
        }

    def problems(self) -> list[str]:
        holds = self.trainer.holds_pool if self.trainer else None
        return allocation_problems(self.spec, self.agent_views(), self.scheduler_views(), holds)

    def check_owners(self) -> None:
        """Every sequence one owner: the ledger matches the queues and replicas, and no
        sequence runs on two agents of a role."""
        for role, scheduler in self.schedulers.items():
            check_ownership(scheduler.core.ledger, scheduler.core)
            seen: dict[int, str] = {}
            for agent in self.agents.values():
                if agent.role is not role:
                    continue
                running = agent.state().running
                for seq_id in running:
                    assert seq_id not in seen, f"{seq_id} runs on {seen[seq_id]} and {agent.name}"
                    seen[seq_id] = agent.name
                # what an agent runs, its scheduler has placed on its replica
                placed = (
                    {s.id for s in scheduler.core.running_on(agent.replica)}
                    if agent.replica in scheduler.routes
                    else set()
                )
                assert set(running) <= placed, f"{agent.name} runs {set(running) - placed}"

    def check_outputs(self) -> None:
        """Each submitted sequence completed exactly once, with its scripted tokens."""
        for role, works in self.submitted.items():
            got = self.sink.got[role]
            ids = [c.seq_id for c in got]
            assert len(ids) == len(set(ids)), f"{role}: completed twice: {len(ids) - len(set(ids))}"
            assert set(ids) == set(works), f"{role}: missing {sorted(set(works) - set(ids))[:5]}"
            for c in got:
                w = works[c.seq_id]
                assert c.token_ids == script(w.sampling.seed, w.sampling.max_new_tokens)
            counts = self.schedulers[Role(role)].core.ledger.counts()
            assert counts["done"] == counts["submitted"] == len(works)

    def reprefills(self, role: str) -> list[tuple[int, int]]:
        return [
            (seq_id, n)
            for engines in self.engines.values()
            for seq_id, n in engines[role].added
            if n > 0
        ]

    def roles(self) -> dict[int, str]:
        return {d: a.role.value for d, a in self.agents.items()}


def rollout_heavy_layout() -> dict[int, tuple[str, str, tuple[int, ...]]]:
    return {
        0: ("rollout", "rollout@0", (0,)),
        1: ("rollout", "rollout@1", (1,)),
        2: ("rollout", "rollout@2", (2,)),
        3: ("reward", "reward@3", (3,)),
    }


# --- shifting end to end ---------------------------------------------------------------------


def test_reward_backlog_takes_rollout_replicas_and_gives_them_back(tmp_path):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        await cluster.start()
        # rollout replicas run a few long sequences; the reward queue backs up
        await cluster.submit("rollout", 0, 6, 60)
        await cluster.submit("reward", 1000, 60, 20)
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await controller.recovered.wait()
        assert cluster.problems() == []
        await cluster.until(lambda: controller.shifts_done >= 1, "a first shift")
        first = cluster.monitor.of(ShiftStarted)[0]
        assert first.receiver is Role.REWARD and first.kind == "shift"
        victims = [m.replica_id for m in first.moves if m.kind == "evict"]
        assert victims and all(v.startswith("rollout@") for v in victims)
        assert cluster.problems() == []
        cluster.check_owners()
        await cluster.until(cluster.all_done, "the first workload")
        # aborted rollout sequences went elsewhere with their partial output and finished
        assert any(n > 0 for _, n in cluster.reprefills("rollout"))
        assert sum(r == "reward" for r in cluster.roles().values()) >= 2

        # now rollout is the bottleneck and reward idles: devices go back
        await clock.sleep(3.0)  # past the cooldown and the new replicas' immunity
        await cluster.submit("rollout", 2000, 60, 30)
        await cluster.until(
            lambda: any(e.receiver is Role.ROLLOUT for e in cluster.monitor.of(ShiftStarted)),
            "a shift back to rollout",
        )
        await cluster.until_done()
        assert sum(r == "rollout" for r in cluster.roles().values()) >= 2
        finished = cluster.monitor.of(ShiftFinished)
        assert [f.outcome for f in finished] == ["done"] * len(finished) and len(finished) >= 2
        # each shift's time splits into its phases, in order, summing to the whole
        for f in finished:
            assert f.kind == "shift"
            assert list(f.phase_s) == [p.value for p in FORWARD[1:]]
            assert sum(f.phase_s.values()) == pytest.approx(f.seconds)
        assert cluster.monitor.of(AllocationChanged)
        report = await cluster.client.request(
            "controller", QueryAllocation(), expect=AllocationReport
        )
        assert report.recovered and report.shifts_done == len(finished)
        assert {m.replica_id: m.devices for m in report.replicas} == {
            a.replica: tuple(a.devices) for a in cluster.agents.values()
        }
        # every measured shift time went into the planner's running average
        expected = SETTINGS.planner.migrate_time_init_s
        for f in finished:
            alpha = SETTINGS.planner.migrate_time_alpha
            expected = (1 - alpha) * expected + alpha * f.seconds
        assert controller.planner.migrate_time_s == pytest.approx(expected)
        assert expected < SETTINGS.planner.migrate_time_init_s
        cluster.check_outputs()
        cluster.check_owners()
        assert cluster.problems() == []
        await cluster.stop()

    run_virtual(main)


def test_the_controller_publishes_its_decisions_when_they_change_or_every_few_seconds(tmp_path):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        await cluster.start()
        await cluster.submit("reward", 1000, 60, 20)
        controller = cluster.make_controller(open_journal(tmp_path / "journal"))
        controller.settings = msgspec.structs.replace(SETTINGS, decisions_every_s=2.0)
        cluster.controller = controller
        await controller.start()
        await cluster.until(lambda: controller.shifts_done >= 1, "a first shift")
        await cluster.until_done()
        await clock.sleep(6.0)
        await cluster.stop()
        return cluster.monitor.of(PlannerDecided)

    decisions = run_virtual(main)
    acted = [d for d in decisions if d.acted]
    assert acted and acted[0].bottleneck == ["reward"]
    assert acted[0].candidate.startswith("shift: reward +") and acted[0].score > 0
    assert acted[0].horizon_s == SETTINGS.planner.horizon_s
    # a decision that says what the last one said (but for its numbers) waits its turn:
    # at most one per 2 s, where the controller plans every 0.5 s
    repeats = [
        b.at - a.at
        for a, b in itertools.pairwise(decisions)
        if not b.acted and decision_kind(a) == decision_kind(b)
    ]
    assert repeats and all(gap >= 2.0 for gap in repeats)


def test_trainer_pool_is_lent_then_reclaimed_whole(tmp_path):
    async def main(clock):
        layout = {
            0: ("rollout", "rollout@0", (0,)),
            1: ("reward", "reward@1", (1,)),
            2: ("training", "trainer", (2, 3)),
            3: ("training", "trainer", (2, 3)),
        }
        cluster = Cluster(clock, trainer_cluster(), layout, trainer=True)
        trainer = cluster.trainer
        await cluster.start()
        await cluster.submit("reward", 0, 80, 40)
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await controller.recovered.wait()
        assert cluster.problems() == []
        # the idle trainer lends its pool; the reward backlog takes it
        await cluster.until(
            lambda: cluster.roles()[2] == "reward" and cluster.roles()[3] == "reward",
            "reward replicas on the lent pool",
        )
        assert trainer.calls == ["offload"] and not trainer.holds_pool
        kinds = [e.kind for e in cluster.monitor.of(ShiftStarted)]
        assert kinds[0] == "lend_trainer"
        await clock.sleep(0.5)  # let the new replicas fill up
        running_on_pool = sum(len(cluster.agents[d].state().running) for d in (2, 3))
        assert running_on_pool > 0

        # a batch is ready: the trainer takes its pool back, whole
        await cluster.client.request("controller", TrainerPhaseChanged(phase="ready"))
        await cluster.until(lambda: trainer.holds_pool, "the pool reclaimed")
        await cluster.until(lambda: controller.shift is None, "the reclaim finished")
        assert trainer.calls == ["offload", "reload"]
        assert cluster.roles() == {0: "rollout", 1: "reward", 2: "training", 3: "training"}
        assert cluster.problems() == []
        cluster.check_owners()
        # ready until it trains: the pool is not lent again meanwhile
        await clock.sleep(2.0)
        assert trainer.calls == ["offload", "reload"]
        trainer.state = "training"
        await clock.sleep(2.0)
        assert trainer.calls == ["offload", "reload"]
        assert cluster.roles()[2] == "training"
        # trained: idle with its pool, so it lends it again
        trainer.state = "idle"
        await cluster.until(lambda: not trainer.holds_pool, "the pool lent again")
        assert trainer.calls == ["offload", "reload", "offload"]
        await cluster.until_done()
        # the sequences the pool's replicas were running finished elsewhere, continued
        assert any(n > 0 for _, n in cluster.reprefills("reward"))
        cluster.check_outputs()
        cluster.check_owners()
        assert cluster.problems() == []
        await cluster.stop()

    run_virtual(main)


@pytest.mark.parametrize("taken", [True, False])
def test_a_packed_reward_tail_moves_its_judgments_only_once_the_step_takes_it(tmp_path, taken):
    """A trainer-bound run (time constant 0.1 s) offers the lighter of two busy reward
    replicas: taken, its routing is cut and its judgments finish on the other; refused, it
    keeps them and stays routable."""

    async def main(clock):
        spec = trainer_cluster()
        layout = {
            0: ("reward", "reward@0", (0,)),
            1: ("reward", "reward@1", (1,)),
            2: ("training", "trainer", (2, 3)),
            3: ("training", "trainer", (2, 3)),
        }
        cluster = Cluster(clock, spec, layout, trainer=True)
        trainer = cluster.trainer
        trainer.takes = {"reward@0", "reward@1"} if taken else set()
        await cluster.start()
        await cluster.submit("reward", 0, 3, 400)
        await cluster.until(
            lambda: all(cluster.agents[d].state().running for d in (0, 1)), "both judging"
        )
        light = min((0, 1), key=lambda d: len(cluster.agents[d].state().running))
        moved = set(cluster.agents[light].state().running)
        other = 1 - light
        trainer.state = "training"
        kwargs = cluster.controller_kwargs(open_journal(tmp_path / "journal"))
        settings = PlannerSettings(trainer_bound_window_s=0.1, lend_trainer_pool=False)
        kwargs["policy"] = Planner(spec, {Role.ROLLOUT: MODEL, Role.REWARD: MODEL}, settings)
        cluster.controller = controller = Controller("controller", cluster.bus, **kwargs)
        await controller.start()
        await cluster.until(lambda: f"reward@{light}" in trainer.offered, "the tail offered")
        await clock.sleep(0.2)
        cut = cluster.schedulers[Role.REWARD].cut
        if taken:
            assert cut == {f"reward@{light}"}
            assert not cluster.agents[light].state().running
            assert moved <= set(cluster.agents[other].state().running)
        else:
            assert not cut and set(cluster.agents[light].state().running) == moved
        trainer.state = "idle"  # the step over: routed to again
        await cluster.until(lambda: not cluster.schedulers[Role.REWARD].cut, "routes restored")
        await cluster.until_done()
        cluster.check_outputs()
        cluster.check_owners()
        assert bool(cluster.reprefills("reward")) is taken
        await cluster.stop()

    run_virtual(main)


def test_a_trainer_that_trains_without_its_pool_gets_it_back(tmp_path):
    """A batch reached the trainer while its pool was lent: reclaim, without being told."""

    async def main(clock):
        layout = {0: ("rollout", "rollout@0", (0,)), 1: ("reward", "reward@1", (1,))}
        cluster = Cluster(clock, trainer_cluster(), layout, trainer=True)
        cluster.trainer.lend()
        await cluster.start()
        await cluster.submit("reward", 0, 40, 40)
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await cluster.until(lambda: cluster.roles()[2] == "reward", "the pool serving reward")
        cluster.trainer.state = "training"
        await cluster.until(lambda: cluster.roles()[2] == "training", "the pool reclaimed")
        await cluster.until(lambda: controller.shift is None, "the reclaim finished")
        assert cluster.trainer.calls == ["reload"] and cluster.problems() == []
        await cluster.finish()

    run_virtual(main)


def test_a_restarted_controller_reads_a_waiting_trainer_as_lent_and_reclaims(tmp_path):
    """The Controller restarts while a batch waits for the lent pool (state "training",
    pool serving reward): recovery must read the pool as lent, not as training, and then
    reclaim it for the waiting batch."""

    async def main(clock):
        layout = {0: ("rollout", "rollout@0", (0,)), 1: ("reward", "reward@1", (1,))}
        cluster = Cluster(clock, trainer_cluster(), layout, trainer=True)
        cluster.trainer.lend()
        await cluster.start()
        await cluster.submit("reward", 0, 40, 40)
        first = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await cluster.until(lambda: cluster.roles()[2] == "reward", "the pool serving reward")
        await cluster.until(lambda: first.shift is None, "the lend finished")
        await first.stop()
        first.journal.close()
        cluster.trainer.state = "training"  # a batch arrived; the pool is still lent
        second = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await second.recovered.wait()
        assert second.recovery_problems == []
        # the planner resumes from the journal: the same shift-time average as before
        assert first.planner.migrate_time_s != SETTINGS.planner.migrate_time_init_s
        assert second.planner.migrate_time_s == pytest.approx(first.planner.migrate_time_s)
        assert not any(r.role is Role.TRAINING for r in second.allocation.replicas.values())
        await cluster.until(lambda: cluster.roles()[2] == "training", "the pool reclaimed")
        assert cluster.trainer.calls == ["reload"] and cluster.problems() == []
        await cluster.finish()

    run_virtual(main)


# --- crash and recovery ----------------------------------------------------------------------

RECORDS_PER_SHIFT = 7  # planned, routing_cut, aborted, released, acquired, registered, done


@pytest.mark.parametrize(
    "when", [("before", n) for n in range(1, 8)] + [("after", n) for n in range(1, 8)]
)
def test_controller_killed_between_journal_records_recovers(tmp_path, when):
    side, n = when

    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        await cluster.start()
        await cluster.submit("rollout", 0, 6, 60)
        await cluster.submit("reward", 1000, 40, 20)
        path = tmp_path / "journal"
        journal = CrashingJournal(path, **{side: n})
        first = await cluster.run_controller(journal)
        await cluster.until(lambda: first.failure is not None, f"the kill {side} record {n}")
        assert isinstance(first.failure, Killed)
        journal.close()
        await clock.sleep(0.3)  # anything the dead Controller had sent lands meanwhile
        cluster.check_owners()

        second = await cluster.run_controller(open_journal(path, fsync=False))
        await second.recovered.wait()
        assert second.journal_problems == []
        assert cluster.problems() == []
        cluster.check_owners()
        records = second.journal.replay().records
        phases = [getattr(r, "phase", "planned") for r in records]
        if side == "after" and n == RECORDS_PER_SHIFT or side == "before" and n == 1:
            assert "rolled_back" not in phases
        else:
            # the interrupted shift was finished (forward) or undone (back), never left open
            assert phases[-1] in ("done", "rolled_back")
            assert ("rolled_back" in phases) == (n <= (2 if side == "after" else 3))
        await cluster.until_done()
        cluster.check_outputs()
        cluster.check_owners()
        assert cluster.problems() == []
        await cluster.stop()

    run_virtual(main)


def test_recovery_reconciles_a_half_acquired_replica_and_a_stale_registration(tmp_path):
    """No journal at all, and agents and schedulers that disagree: the Controller makes
    them agree before it plans."""

    async def main(clock):
        layout = rollout_heavy_layout()
        cluster = Cluster(clock, four_devices(), layout)
        await cluster.start()
        await cluster.submit("rollout", 0, 6, 30)
        await clock.sleep(0.05)
        # device 2's agent lost its role behind the scheduler's back
        rollout2 = cluster.agents[2]
        assert rollout2.state().running
        # the scheduler still routes to rollout@2; the agent is told to evacuate by no one
        rollout2.engine.abort(None)
        rollout2._held.clear()
        rollout2.role, rollout2.replica, rollout2.engine = Role.FREE, None, None
        assert cluster.problems() != []
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await controller.recovered.wait()
        assert controller.recovery_problems
        assert cluster.problems() == []
        assert "rollout@2" not in cluster.schedulers[Role.ROLLOUT].routes
        await cluster.finish()

    run_virtual(main)


def test_recovery_forces_out_the_replica_of_an_agent_that_restarted_while_it_was_down(tmp_path):
    """Device 2's agent dies holding rollout@2 and its supervisor starts it again (free) before
    any Controller runs: the scheduler still routes to rollout@2 under the same agent name,
    but another instance answers, so recovery removes the replica forced (no process holds
    its partial output) and its sequences run elsewhere, each once."""
    stream = io.StringIO()
    configure_logging("info", json=True, stream=stream)

    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        await cluster.start()
        await cluster.submit("rollout", 0, 6, 30)
        await clock.sleep(0.05)
        dead = cluster.agents[2]
        assert dead.state().running
        await dead.stop()  # its engines (the process's memory) are gone with it
        engines = cluster.engines[2] = {"rollout": scripted_engine(), "reward": scripted_engine()}
        again = cluster.agents[2] = RoleAgent(
            dead.name,
            cluster.bus,
            device=2,
            engines=engines,
            weights={"rollout": no_weights, "reward": no_weights},
            stepping=Inline(pace=True),
            report_timeout=5.0,
        )
        await again.start()
        assert again.incarnation != dead.incarnation
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await controller.recovered.wait()
        assert any("rollout@2" in p and "restarted" in p for p in controller.recovery_problems)
        assert "rollout@2" not in cluster.schedulers[Role.ROLLOUT].routes
        await cluster.finish()

    run_virtual(main)
    removed = [
        line
        for line in map(json.loads, stream.getvalue().splitlines())
        if line["event"] == "replica removed" and line["replica"] == "rollout@2"
    ]
    assert [(r["forced"], r["requeued"] > 0) for r in removed] == [(True, True)]


# --- bad input -------------------------------------------------------------------------------


def test_bad_messages_get_error_replies_and_the_controller_keeps_running(tmp_path):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        await cluster.start()
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await controller.recovered.wait()
        client = cluster.client
        with pytest.raises(RemoteError) as unknown:
            await client.request("controller", Assign(sequences=[]))
        assert unknown.value.code == "no_handler"
        with pytest.raises(RemoteError) as bad_phase:
            await client.request("controller", TrainerPhaseChanged(phase="sleeping"))
        assert "sleeping" in str(bad_phase.value)
        raw = await cluster.bus.transport.request("controller", b"\x93garbage", 5.0)
        error = cluster.bus.codec.decode_reply(raw)
        assert error.body.code == "bad_message"
        await clock.sleep(2.0)  # a few planning ticks
        assert controller.failure is None
        report = await client.request("controller", QueryAllocation(), expect=AllocationReport)
        assert report.recovered and len(report.replicas) == 4
        await cluster.stop()

    run_virtual(main)


# --- crash in the middle of a phase; a wake that cannot be done -----------------------------


class KillOnCommand(Controller):
    """Dies right before sending its n-th shift command."""

    kill_at = 0

    async def _send(self, command):
        type(self).kill_at -= 1
        if type(self).kill_at == 0:
            raise Killed(f"before command {command!r}")
        return await super()._send(command)


# the first shift's 8 commands: cut, evacuate, release and acquire for each of its two
# replicas (one-device wakes register as they acquire: a kill after an Acquire leaves a
# registered replica whose journal says released)
@pytest.mark.parametrize("k", range(1, 9))
def test_controller_killed_between_two_commands_of_a_phase_recovers(tmp_path, k):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        await cluster.start()
        await cluster.submit("rollout", 0, 6, 60)
        await cluster.submit("reward", 1000, 40, 20)
        path = tmp_path / "journal"
        KillOnCommand.kill_at = k
        first = KillOnCommand(
            "controller", cluster.bus, **cluster.controller_kwargs(open_journal(path, fsync=False))
        )
        cluster.controller = first
        await first.start()
        await cluster.until(lambda: first.failure is not None, f"the kill at command {k}")
        first.journal.close()
        await clock.sleep(0.3)
        second = await cluster.run_controller(open_journal(path, fsync=False))
        await second.recovered.wait()
        assert cluster.problems() == []
        cluster.check_owners()
        await cluster.until_done()
        cluster.check_outputs()
        assert cluster.problems() == []
        await cluster.stop()

    run_virtual(main)


class RefusesFirstRegistration(Scheduler):
    """Refuses each replica's first registration once armed (the scheduler was briefly
    unable to take it while a shift registered it)."""

    armed = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refused: list[str] = []

    @handles
    def register(self, msg: RegisterReplica) -> Ack:
        if self.armed and msg.replica not in self.refused:
            self.refused.append(msg.replica)
            raise ValueError(f"not now: {msg.replica}")
        return super().register(msg)


class SyncLog(Journal):
    """Says, for each record, whether it was synced, and whether one was left unsynced."""

    def __init__(self, path) -> None:
        super().__init__(path, type_=ShiftRecord, fsync=False)
        self.records: list[tuple[str, bool]] = []
        self.unsynced = False

    def append(self, record, *, durable: bool = True) -> None:
        super().append(record, durable=durable)
        self.records.append((getattr(record, "phase", "planned"), durable))
        self.unsynced = not durable


class ChecksDurability(Controller):
    """Asserts that every record is durable before any command goes out."""

    async def _send(self, command):
        assert not self.journal.unsynced, f"{command!r} went out before its record was synced"
        return await super()._send(command)


def test_a_shift_syncs_its_journal_only_before_a_command(tmp_path):
    def to_reward(*devices: int) -> ShiftPlan:
        evictions = [Move("evict", f"rollout@{d}", Role.ROLLOUT, (d,)) for d in devices]
        wakes = [Move("wake", f"reward@{d}", Role.REWARD, (d,)) for d in devices]
        return ShiftPlan(kind="shift", receiver=Role.REWARD, moves=(*evictions, *wakes))

    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        await cluster.start()
        journal = SyncLog(tmp_path / "journal")
        controller = ChecksDurability(
            "controller", cluster.bus, **cluster.controller_kwargs(journal)
        )
        cluster.controller = controller
        await controller.start()
        await controller.recovered.wait()
        # a lone victim needs no routing cut: its plan's record is synced with the cut's,
        # right before the evacuation; several victims are cut first, after the plan's sync
        for devices, planned_synced in (((2,), False), ((0, 1), True)):
            journal.records.clear()
            txn = await controller.execute(to_reward(*devices))
            assert txn.phase.value == "done"
            assert journal.records[:2] == [("planned", planned_synced), ("routing_cut", True)]
        assert sorted(cluster.schedulers[Role.REWARD].routes) == [
            "reward@0",
            "reward@1",
            "reward@2",
            "reward@3",
        ]
        assert cluster.problems() == []
        await cluster.finish()

    run_virtual(main)


def test_a_one_device_wake_is_registered_by_the_controller_from_its_acquire(tmp_path):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        reward = cluster.schedulers[Role.REWARD]
        await cluster.start()
        registrations: list[tuple[str, RegisterReplica]] = []
        for agent in cluster.agents.values():
            request = agent.request

            async def counted(to, message, *args, _request=request, _agent=agent, **kwargs):
                if isinstance(message, RegisterReplica):
                    registrations.append((_agent.name, message))
                return await _request(to, message, *args, **kwargs)

            agent.request = counted
        await cluster.submit("rollout", 0, 6, 60)
        await cluster.submit("reward", 1000, 60, 20)
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await cluster.until(lambda: controller.shifts_done >= 1, "a first shift")
        woken = [
            m.replica_id for m in cluster.monitor.of(ShiftStarted)[0].moves if m.kind == "wake"
        ]
        # the new replicas serve without one request of their agents to the scheduler: the
        # Controller registered them, with what their agents said in their replies
        assert woken and set(woken) <= set(reward.routes)
        assert registrations == []
        for replica in woken:
            agent = next(a for a in cluster.agents.values() if a.replica == replica)
            assert reward._agents[replica] == agent.name
            assert reward._agent_incarnations[replica] == agent.incarnation
        assert cluster.problems() == []
        await cluster.finish()

    run_virtual(main)


def test_a_registration_that_fails_on_acquire_is_sent_again_in_its_phase(tmp_path):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        reward = RefusesFirstRegistration(
            SCHEDULERS[Role.REWARD],
            cluster.bus,
            role=Role.REWARD,
            router=make_router(ROUTER, MODEL),
            downstream="sink",
            request_timeout=5.0,
        )
        cluster.schedulers[Role.REWARD] = reward
        await cluster.start()
        reward.armed = True
        await cluster.submit("rollout", 0, 6, 60)
        await cluster.submit("reward", 1000, 60, 20)
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await cluster.until(lambda: controller.shifts_done >= 1, "a first shift")
        first = cluster.monitor.of(ShiftFinished)[0]
        woken = [
            m.replica_id for m in cluster.monitor.of(ShiftStarted)[0].moves if m.kind == "wake"
        ]
        # each new reward replica's registration on acquire was refused, then its Register
        # (the registered phase) took it: the shift is done with nothing given up
        assert woken and reward.refused == woken
        assert first.outcome == "done" and first.failed == []
        assert set(woken) <= set(reward.routes)
        assert cluster.problems() == []
        await cluster.finish()

    run_virtual(main)


def test_a_wake_whose_agent_refuses_is_given_up_and_its_device_left_free(tmp_path):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), rollout_heavy_layout())
        # device 2's agent cannot serve reward
        del cluster.agents[2].engines[Role.REWARD]
        await cluster.start()
        await cluster.submit("rollout", 0, 6, 60)
        await cluster.submit("reward", 1000, 60, 20)
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await cluster.until(lambda: cluster.monitor.of(ShiftFinished), "the first shift")
        done = cluster.monitor.of(ShiftFinished)[0]
        assert done.outcome == "done" and done.failed == ["reward@2"]
        assert cluster.roles()[2] == "free" and cluster.roles()[1] == "reward"
        assert "reward@2" not in controller.allocation.replicas
        assert cluster.problems() == []
        await cluster.finish()

    run_virtual(main)


# --- the shift protocol of schedulers and agents ---------------------------------------------


async def _routed_around_the_last(clock, replicas: int) -> Cluster:
    """``replicas`` rollout replicas and six sequences running on all but the last, which
    was cut while they were routed, then restored (a migration's target)."""
    layout = {d: ("rollout", f"rollout@{d}", (d,)) for d in range(replicas)}
    cluster = Cluster(clock, four_devices(), layout)
    await cluster.start()
    target = f"rollout@{replicas - 1}"
    await cluster.client.request("rollout-sched", CutRouting(replica=target))
    await cluster.submit("rollout", 0, 6, 40)
    await clock.sleep(0.1)
    assert cluster.schedulers[Role.ROLLOUT].core.running_on(target) == []
    await cluster.client.request("rollout-sched", RestoreRouting(replica=target))
    return cluster


async def _six_on_rollout_0_three_to_move(clock) -> tuple[Cluster, list[SequenceMigration]]:
    """Two rollout replicas, six sequences running on the first, and the migrations of three
    of them to the second."""
    cluster = await _routed_around_the_last(clock, 2)
    assert len(cluster.schedulers[Role.ROLLOUT].core.running_on("rollout@0")) == 6
    return cluster, [SequenceMigration(i, "rollout@0", "rollout@1") for i in (0, 1, 2)]


def test_cut_routing_stops_new_work_and_migration_moves_running_sequences(tmp_path):
    async def main(clock):
        cluster, moves = await _six_on_rollout_0_three_to_move(clock)
        scheduler, client = cluster.schedulers[Role.ROLLOUT], cluster.client
        target = cluster.engines[1]["rollout"]
        # the target is busy (as a new replica prefilling its first sequences is): its
        # Assign waits, and the reply (the shift's end) does not wait for it
        async with cluster.agents[1]._engine_lock:
            moved = await client.request(
                "rollout-sched", MigrateSequences(migrations=moves), expect=Ack, timeout=1.0
            )
            assert moved.count == 3
            assert sorted(s.id for s in scheduler.core.running_on("rollout@1")) == [0, 1, 2]
            assert [s for s, n in target.added if n > 0] == []
        await cluster.until(lambda: len(target.added) == 3, "the migrated sequences' Assign")
        assert [s for s, n in target.added if n > 0] == [0, 1, 2]
        cluster.check_owners()
        assert scheduler.migrations == []  # recorded once the sequences finish
        # unknown replicas are no-ops: the commands are idempotent
        again = await client.request(
            "rollout-sched", RemoveReplica(replica="rollout@9"), expect=ReplicaRemoved
        )
        assert not again.known
        await cluster.until_done()
        cluster.check_outputs()
        # each migrated sequence's timings: abort and dispatch on the scheduler's clock, the
        # re-prefill as the receiving engine reported it (three admitted in one step)
        timings = sorted(scheduler.migrations, key=lambda m: m.seq_id)
        assert [m.seq_id for m in timings] == [0, 1, 2]
        assert all(m.tokens > 0 and m.abort_s >= 0.0 and m.dispatch_s >= 0.0 for m in timings)
        assert [m.reprefill_s for m in timings] == [3 * PREFILL_S] * 3
        await cluster.stop()

    run_virtual(main)


def test_a_migration_target_removed_before_its_assign_goes_out_loses_nothing(tmp_path):
    async def main(clock):
        cluster, moves = await _six_on_rollout_0_three_to_move(clock)
        scheduler = cluster.schedulers[Role.ROLLOUT]
        # the two handlers back to back: the target's forced removal (its agent died) comes
        # before the task that sends the migrated sequences' Assign has run
        moved = await scheduler.migrate(MigrateSequences(migrations=moves))
        removed = await scheduler.remove_replica(RemoveReplica(replica="rollout@1", force=True))
        assert moved.count == 3 and removed.requeued == 3
        await cluster.until_done()
        cluster.check_outputs()
        assert cluster.engines[1]["rollout"].added == []  # the Assign went nowhere
        assert scheduler.core.replicas == ["rollout@0"]
        await cluster.stop()

    run_virtual(main)


async def _sequences_on_two_sources(clock) -> tuple[Cluster, list[SequenceMigration]]:
    """Three rollout replicas, sequences running on the first two, and the migrations of one
    from each to the third."""
    cluster = await _routed_around_the_last(clock, 3)
    scheduler = cluster.schedulers[Role.ROLLOUT]
    first, second = (scheduler.core.running_on(f"rollout@{d}") for d in (0, 1))
    assert first and second
    return cluster, [
        SequenceMigration(first[0].id, "rollout@0", "rollout@2"),
        SequenceMigration(second[0].id, "rollout@1", "rollout@2"),
    ]


def test_a_migration_aborts_at_every_source_at_once(tmp_path):
    async def main(clock):
        cluster, moves = await _sequences_on_two_sources(clock)

        stepping = True

        async def steps_back_to_back(agent):
            while stepping:
                async with agent._engine_lock:  # an Abort waits for the step in flight
                    await clock.sleep(1.0)
                await clock.sleep(0)

        steps = [asyncio.ensure_future(steps_back_to_back(cluster.agents[d])) for d in (0, 1)]
        await clock.sleep(0)
        began = clock.now()
        moved = await cluster.client.request(
            "rollout-sched", MigrateSequences(migrations=moves), expect=Ack, timeout=5.0
        )
        # one step's wait: one source after the other would wait for the second source's
        # next step as well
        assert moved.count == 2 and clock.now() - began < 1.5
        stepping = False
        await asyncio.gather(*steps)
        await cluster.finish()

    run_virtual(main)


def test_a_migration_whose_source_fails_still_assigns_what_the_others_gave_up(tmp_path):
    async def main(clock):
        cluster, moves = await _sequences_on_two_sources(clock)
        scheduler, target = cluster.schedulers[Role.ROLLOUT], cluster.engines[2]["rollout"]

        def broken(seq_ids=None):
            raise RuntimeError("engine fault")

        cluster.engines[1]["rollout"].abort = broken
        with pytest.raises(RemoteError, match="engine fault"):
            await cluster.client.request("rollout-sched", MigrateSequences(migrations=moves))
        # rollout@0's sequence was taken and placed on rollout@2: its Assign went out
        moved = moves[0].seq_id
        assert [s.id for s in scheduler.core.running_on("rollout@2")] == [moved]
        await cluster.until(lambda: moved in [s for s, _ in target.added], "its Assign")
        del cluster.engines[1]["rollout"].abort
        await cluster.finish()

    run_virtual(main)


def test_remove_replica_keeps_partial_output_in_the_work(tmp_path):
    async def main(clock):
        layout = {0: ("rollout", "rollout@0", (0,))}
        cluster = Cluster(clock, four_devices(), layout)
        await cluster.start()
        await cluster.submit("rollout", 0, 3, 40)
        await clock.sleep(0.2)
        scheduler = cluster.schedulers[Role.ROLLOUT]
        removed = await cluster.client.request(
            "rollout-sched", RemoveReplica(replica="rollout@0"), expect=ReplicaRemoved
        )
        assert removed.known and removed.requeued == 3
        assert scheduler.core.replicas == [] and len(scheduler.core.queue) == 3
        for seq_id in range(3):
            work = scheduler._work[seq_id]
            assert 0 < len(work.generated_ids) < 40
            assert work.generated_ids == script(seq_id, 40)[: len(work.generated_ids)]
            assert len(work.generated_logprobs) == len(work.generated_ids)
        agent = cluster.agents[0]
        assert agent.state().running == [] and not agent.state().serving
        # the replica is gone: a second removal is a no-op
        again = await cluster.client.request(
            "rollout-sched", RemoveReplica(replica="rollout@0"), expect=ReplicaRemoved
        )
        assert not again.known
        cluster.check_owners()
        await cluster.stop()

    run_virtual(main)


def _gps_agent(bus: Bus, engine: ScriptedEngine, loader: WeightLoader, **kwargs) -> RoleAgent:
    """A free agent that may take rollout, reading its weights through ``loader``."""
    return RoleAgent(
        "agent-0",
        bus,
        device=0,
        engines={"rollout": engine},
        weights={"rollout": loader},
        stepping=Inline(),
        **kwargs,
    )


def test_acquire_reads_weights_from_gps_and_release_frees_the_device():
    import torch

    from pivot.actors.agent import StoreWeights
    from pivot.actors.param_store import ParameterStore

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        with ParameterStore() as store:
            weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
            store.write(weights, version=3)
            engine = scripted_engine()
            loader = StoreWeights(
                store.name, like={n: torch.zeros_like(t) for n, t in weights.items()}
            )
            agent = _gps_agent(bus, engine, loader, models={"rollout": "policy"})
            client = Actor("client", bus)
            await agent.start()
            await client.start()
            assert agent.state().role is Role.FREE and engine.stats().released
            # a small read is made on start, so the first Acquire pays no allocation and plan
            assert all(torch.equal(loader._buffers[n], weights[n]) for n in weights)
            acquire = Acquire(
                role=Role.ROLLOUT, replica="rollout@0", devices=[0], model="policy", min_version=3
            )
            state = await client.request("agent-0", acquire, expect=AgentState)
            assert (state.role, state.replica, state.weights_version) == (
                Role.ROLLOUT,
                "rollout@0",
                3,
            )
            ((loaded, version),) = engine.loaded
            assert version == 3 and all(torch.equal(loaded[n], weights[n]) for n in weights)
            assert not engine.stats().released
            # the same Acquire again changes nothing; another replica is refused
            await client.request("agent-0", acquire, expect=AgentState)
            assert len(engine.loaded) == 1
            with pytest.raises(RemoteError, match="releasing"):
                await client.request(
                    "agent-0",
                    Acquire(role=Role.REWARD, replica="reward@0", devices=[0]),
                )
            state = await client.request("agent-0", Release(replica="rollout@0"), expect=AgentState)
            assert state.role is Role.FREE and state.replica is None
            assert set(engine.stats().released) == {ContextKind.TRANSIENT, ContextKind.WEIGHTS}
            # a version GPS does not have yet: refused, and the engine stays released
            with pytest.raises(RemoteError, match="version 4"):
                await client.request(
                    "agent-0",
                    Acquire(role=Role.ROLLOUT, replica="rollout@0", devices=[0], min_version=4),
                )
            assert agent.state().role is Role.FREE and engine.stats().released
            with pytest.raises(RemoteError, match="model 'policy'"):
                await client.request(
                    "agent-0",
                    Acquire(role=Role.ROLLOUT, replica="rollout@0", devices=[0], model="genrm"),
                )
            described = await client.request("agent-0", Describe(), expect=AgentState)
            assert described.role is Role.FREE
            await client.stop()
            await agent.stop()
            loader.close()

    run_virtual(main)


def test_an_agent_stages_the_newest_policy_of_a_role_it_does_not_hold_so_a_shift_reads_none():
    import torch

    from pivot.actors.agent import STAGE_POLL_S, StoreWeights
    from pivot.actors.param_store import ParameterStore

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        with ParameterStore() as store:
            store.write({"w": torch.zeros(2, 3)}, version=3)
            engine = scripted_engine()
            loader = StoreWeights(store.name, like={"w": torch.zeros(2, 3)})
            agent = _gps_agent(bus, engine, loader)
            client = Actor("client", bus)
            await agent.start()
            await client.start()
            reads = []
            read = loader._open().read
            loader._reader.read = lambda into: reads.append(1) or read(into)
            # the agent is free: a version published meanwhile is read within a poll
            store.write({"w": torch.full((2, 3), 4.0)}, version=4)
            await clock.sleep(2 * STAGE_POLL_S)
            assert loader.version == 4 and torch.equal(
                loader._buffers["w"], torch.full((2, 3), 4.0)
            )
            assert len(reads) == 1
            await clock.sleep(2 * STAGE_POLL_S)
            assert len(reads) == 1  # nothing newer: no read
            # the shift onto the role loads what is staged and reads nothing
            await client.request(
                "agent-0",
                Acquire(role=Role.ROLLOUT, replica="rollout@0", devices=[0], min_version=4),
            )
            ((loaded, version),) = engine.loaded
            assert version == 4 and torch.equal(loaded["w"], torch.full((2, 3), 4.0))
            assert len(reads) == 1
            # the role held is catch_up's: no staging behind the engine's back
            store.write({"w": torch.full((2, 3), 5.0)}, version=5)
            await clock.sleep(2 * STAGE_POLL_S)
            assert loader.version == 4 and len(reads) == 1
            await client.stop()
            await agent.stop()
            loader.close()

    run_virtual(main)


def test_an_agent_dials_its_peers_at_start_and_one_not_serving_stops_nothing():
    class Dialling(LocalTransport):
        def __init__(self) -> None:
            super().__init__()
            self.dialled: list[str] = []

        async def connect(self, to: str, timeout: float) -> None:
            self.dialled.append(to)
            await super().connect(to, timeout)

    async def main(clock):
        transport = Dialling()
        bus = Bus.local(rl_messages(), transport=transport, clock=clock)
        scheduler = Actor("rollout-sched", bus)
        await scheduler.start()
        agent = RoleAgent(
            "agent-0",
            bus,
            device=0,
            engines={"rollout": scripted_engine()},
            stepping=Inline(),
            peers=("rollout-sched", "reward-sched"),  # the second serves nobody yet
        )
        await agent.start()
        await clock.sleep(0.1)
        assert transport.dialled == ["rollout-sched", "reward-sched"]
        assert agent.state().role is Role.FREE and agent.failure is None
        await agent.stop()
        await scheduler.stop()

    run_virtual(main)


def test_a_store_weights_loader_prepares_before_its_store_has_a_version():
    import torch

    from pivot.actors.agent import StoreWeights
    from pivot.actors.param_store import NoVersion, ParameterStore, StoreError

    like = {"w": torch.zeros(2, 3)}
    missing = StoreWeights("pivot-gps-no-such-store", like=like)
    missing.prepare()  # no store yet: only the buffers
    with pytest.raises(StoreError, match="no parameter store"):
        missing("policy", 0)
    with ParameterStore() as store:
        loader = StoreWeights(store.name, like=like)
        loader.prepare()
        with pytest.raises(NoVersion):
            loader("policy", 0)
        store.write({"w": torch.ones(2, 3)}, version=1)
        tensors, version = loader("policy", 1)
        assert version == 1 and torch.equal(tensors["w"], torch.ones(2, 3))
        loader.close()


def test_an_agent_whose_weights_cannot_be_prepared_starts_and_its_acquire_says_why():
    import torch

    from pivot.actors.agent import StoreWeights
    from pivot.actors.param_store import ParameterStore

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        with ParameterStore() as store:
            store.write({"w": torch.ones(2)}, version=1)
            # the engine's weights are named otherwise than the store's
            loader = StoreWeights(store.name, like={"x": torch.zeros(2)})
            agent = _gps_agent(bus, scripted_engine(), loader)
            client = Actor("client", bus)
            await agent.start()  # preparing failed: a warning, not a dead agent
            await client.start()
            with pytest.raises(RemoteError, match="'x'"):
                await client.request(
                    "agent-0", Acquire(role=Role.ROLLOUT, replica="rollout@0", devices=[0])
                )
            assert agent.state().role is Role.FREE
            await client.stop()
            await agent.stop()
            loader.close()

    run_virtual(main)


def test_a_member_of_a_multi_device_replica_holds_the_role_without_an_engine():
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        engine = scripted_engine()
        member = RoleAgent("agent-1", bus, device=1, engines={"reward": engine}, stepping=Inline())
        client = Actor("client", bus)
        await member.start()
        await client.start()
        state = await client.request(
            "agent-1",
            Acquire(role=Role.REWARD, replica="reward@0", devices=[0, 1]),
            expect=AgentState,
        )
        assert state.role is Role.REWARD and state.devices == [0, 1] and not state.serving
        assert engine.stats().released  # only the leader's engine serves
        with pytest.raises(RemoteError, match="not the leader"):
            await client.request("agent-1", Register(replica="reward@0"))
        state = await client.request("agent-1", Release(replica="reward@0"), expect=AgentState)
        assert state.role is Role.FREE
        with pytest.raises(RemoteError, match="not among devices"):
            await client.request(
                "agent-1", Acquire(role=Role.REWARD, replica="reward@2", devices=[2, 3])
            )
        await client.stop()
        await member.stop()

    run_virtual(main)


def test_controller_settings_come_from_toml_and_bad_values_are_named():
    from pivot.config import ConfigError, decode_toml

    settings = decode_toml(
        "interval_s = 2.0\nrelease_kinds = ['transient']\n[planner]\ncooldown_s = 30.0\n",
        ControllerSettings,
        "controller.toml",
    )
    assert settings.interval_s == 2.0 and settings.release_kinds == ("transient",)
    assert settings.planner.cooldown_s == 30.0
    with pytest.raises(ConfigError, match="release_kinds"):
        decode_toml("release_kinds = ['persistent']\n", ControllerSettings, "controller.toml")
    with pytest.raises(ConfigError, match="interval_s"):
        decode_toml("interval_s = 0\n", ControllerSettings, "controller.toml")


def test_a_two_device_reward_replica_wakes_on_two_rollout_devices(tmp_path):
    async def main(clock):
        spec = ClusterSpec.from_config(
            ClusterConfig(
                hosts=2,
                devices_per_host=4,
                rollout=RoleSpec(model="policy"),
                reward=RoleSpec(model="genrm", layout=ReplicaLayout(tp=2)),
            )
        )
        layout = {d: ("rollout", f"rollout@{d}", (d,)) for d in range(6)}
        layout |= {6: ("reward", "reward@6", (6, 7)), 7: ("reward", "reward@6", (6, 7))}
        cluster = Cluster(clock, spec, layout)
        await cluster.start()
        await cluster.submit("rollout", 0, 6, 40)
        await cluster.submit("reward", 1000, 80, 20)
        controller = await cluster.run_controller(open_journal(tmp_path / "journal"))
        await cluster.until(lambda: controller.shifts_done >= 1, "a shift")
        first = cluster.monitor.of(ShiftStarted)[0]
        wakes = [m for m in first.moves if m.kind == "wake"]
        assert wakes
        for woken in wakes:
            assert woken.role is Role.REWARD and len(woken.devices) == 2
            leader, member = (cluster.agents[d].state() for d in woken.devices)
            assert leader.serving and not member.serving
            assert leader.replica == member.replica == woken.replica_id
            assert woken.replica_id in cluster.schedulers[Role.REWARD].routes
        assert cluster.problems() == []
        await cluster.until_done()
        cluster.check_outputs()
        cluster.check_owners()
        await cluster.stop()

    run_virtual(main)


def test_an_assign_that_lost_the_race_to_a_removal_is_not_sent(tmp_path):
    async def main(clock):
        cluster = Cluster(clock, four_devices(), {0: ("rollout", "rollout@0", (0,))})
        await cluster.start()
        scheduler = cluster.schedulers[Role.ROLLOUT]
        works = [
            Work(seq_id=i, prompt_ids=[1] * 10, sampling=SamplingParams(max_new_tokens=9, seed=i))
            for i in range(2)
        ]
        for work in works:  # queued without a kick: this test plays the dispatch loop
            scheduler._work[work.seq_id] = work
            scheduler.core.submit(Sequence(id=work.seq_id, prompt_tokens=10))
        placed = scheduler.core.dispatch()
        assert [d.replica_id for d in placed] == ["rollout@0", "rollout@0"]
        stale = scheduler._assign("rollout@0", works, scheduler._incarnations["rollout@0"])
        # the removal wins the replica's lock, and the replica comes back (same id) before
        # the Assign goes: the new incarnation gets the requeued sequences, once
        await cluster.client.request("rollout-sched", RemoveReplica(replica="rollout@0"))
        await cluster.client.request("agent-0", Register(replica="rollout@0"))
        await clock.sleep(0)
        assert sorted(cluster.agents[0].state().running) == [0, 1]
        await stale
        assert sorted(s for s, _ in cluster.engines[0]["rollout"].added) == [0, 1]
        cluster.check_owners()
        cluster.submitted["rollout"] = {w.seq_id: w for w in works}
        await cluster.finish()

    run_virtual(main)
