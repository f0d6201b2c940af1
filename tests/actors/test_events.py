"""The Monitor as the job's event hub, in-process on the virtual clock: a scripted sequence of
the job's messages (shifts, the planner's decision, the trainer's state, load, step reports,
a restart) becomes the expected records, published in batches, appended to events.jsonl
(each line decodes as an ``EventRecord``), and a watcher that joins late gets the snapshot.
And what ``pivot stop`` asks of the Driver: finish the step in progress, checkpointed, or
stop at once."""

from __future__ import annotations

import msgspec

from pivot.actors.checkpoints import Checkpoints
from pivot.actors.driver import Scores, StepReport
from pivot.actors.event_hub import EventHub
from pivot.actors.messages import (
    EventBatch,
    EventSnapshot,
    QueryEvents,
    QueryStatus,
    ReplicaLoad,
    SchedulerStatus,
    StopAccepted,
    StopJob,
)
from pivot.actors.monitor import Monitor
from pivot.actors.shift_messages import (
    AllocationChanged,
    PlannerDecided,
    ShiftFinished,
    ShiftStarted,
)
from pivot.actors.trainer_messages import TrainerState
from pivot.actors.vocabulary import (
    EVENTS_TOPIC,
    LOAD_TOPIC,
    SHIFT_TOPIC,
    TRAINER_TOPIC,
    rl_messages,
)
from pivot.bus import Actor, Bus, LocalTransport, handles, run_virtual
from pivot.bus.supervisor import SupervisorEvent
from pivot.cluster import Move, Role
from pivot.events import (
    ActorRestarted,
    Alert,
    DeviceMap,
    EventRecord,
    JobPhase,
    PlannerDecision,
    RoleRate,
    ShiftPhase,
    StepDone,
    TrainerPhase,
)
from pivot.job import JobConfig, RolloutSection
from tests.actors.test_rollout_actors import _cluster


class Scheduler(Actor):
    @handles
    def query_status(self, msg: QueryStatus) -> SchedulerStatus:
        return SchedulerStatus(role="rollout", replicas=["r0"], queued=3, running=2, completed=0)


def report(step: int, seconds: float, failures: int = 0) -> StepReport:
    scores = Scores(
        samples=4,
        reward_mean=0.5,
        accuracy=None,
        genrm_agreement=None,
        reward_failures=failures,
        failures_by_cause={"timeout": failures} if failures else {},
        reward_metrics={},
    )
    return StepReport(
        step=step,
        policy_version=step,
        samples=4,
        scores=scores,
        response_tokens=40,
        judgment_tokens=0,
        started_s=10.0 * step,
        rollout_s=seconds / 2,
        seconds=seconds,
        train_s=seconds / 4,
        samples_per_s=4 / seconds,
        tokens_per_s=40 / seconds,
        rollout_by_replica={"r0": 4},
        reward_by_replica={},
    )


def wake(replica: str, role: Role, *devices: int) -> Move:
    return Move("wake", replica, role, devices)


def test_the_hub_turns_the_jobs_messages_into_records_a_late_watcher_catches_up(tmp_path):
    path = tmp_path / "events.jsonl"

    def append(records) -> None:
        with path.open("ab") as f:
            f.write(b"".join(msgspec.json.encode(r) + b"\n" for r in records))

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        hub = EventHub(
            clock.now(),
            steps=4,
            deployment="pivot",
            devices={0: ("rollout", "r0"), 1: ("reward", "m0"), 2: ("training", "trainer")},
            managed=[0, 1, 2],
            sink=append,
        )
        monitor = Monitor(
            "monitor",
            bus,
            agents=["agent-0"],
            schedulers={"rollout": "sched"},
            controller="controller",
            trainer="trainer",
            interval=0.1,
            events=hub,
            events_interval=0.5,
        )
        controller, trainer, agent = (Actor(n, bus) for n in ("controller", "trainer", "agent-0"))
        live, late = Actor("live", bus), Actor("late", bus)
        actors = [Scheduler("sched", bus), monitor, controller, trainer, agent, live]
        for actor in actors:
            await actor.start()
        batches = live.subscribe(EVENTS_TOPIC, publishers="monitor")
        hub.phase(clock.now(), "running")
        await clock.sleep(0.05)  # the monitor follows its topics once it runs
        await agent.publish(
            LOAD_TOPIC,
            ReplicaLoad(
                replica="r0",
                role="rollout",
                running=2,
                kv_tokens=0,
                itl_s=0.01,
                generated_tokens=0,
            ),
        )
        await clock.sleep(0.25)
        await agent.publish(
            LOAD_TOPIC,
            ReplicaLoad(
                replica="r0",
                role="rollout",
                running=2,
                kv_tokens=0,
                itl_s=0.01,
                generated_tokens=100,
            ),
        )
        await controller.publish(
            SHIFT_TOPIC,
            PlannerDecided(
                bottleneck=["reward"],
                acted=True,
                reason="reward queue",
                candidate="reward +1",
                horizon_s=60.0,
                delta_throughput=10.0,
                phi=50.0,
                score=550.0,
                at=clock.now(),
            ),
        )
        # three quick shifts, then one 10x slower: an alert
        for txn, seconds in enumerate([0.2, 0.2, 0.2, 2.0]):
            await controller.publish(
                SHIFT_TOPIC,
                ShiftStarted(
                    txn=txn,
                    kind="shift",
                    receiver=Role.REWARD,
                    moves=[Move("evict", "r0", Role.ROLLOUT, (0,))],
                    reason="",
                    expected_gain=1.0,
                    at=clock.now(),
                ),
            )
            await clock.sleep(seconds)
            await controller.publish(
                SHIFT_TOPIC,
                ShiftFinished(
                    txn=txn,
                    outcome="done",
                    failed=[],
                    seconds=seconds,
                    at=clock.now(),
                    kind="shift",
                    phase_s={"aborted": seconds / 2, "acquired": seconds / 2},
                ),
                AllocationChanged(
                    replicas=[
                        wake("m0", Role.REWARD, 1),
                        wake("m1", Role.REWARD, 0),
                        wake("trainer", Role.TRAINING, 2),
                    ],
                    at=clock.now(),
                ),
            )
        await trainer.publish(
            TRAINER_TOPIC,
            TrainerState(name="trainer", state="training", version=3),
        )
        for step, seconds in enumerate([1.0, 1.0, 1.0, 5.0]):
            monitor.events.step(report(step, seconds, failures=1 if step == 1 else 0))
        hub.supervised(SupervisorEvent(clock.now(), "agent-0", "crashed", "exit code -9"))
        hub.supervised(SupervisorEvent(clock.now(), "agent-0", "started"))
        await clock.sleep(1.0)
        pubs = [pub.message for pub in batches.drain()]
        assert pubs and all(isinstance(m, EventBatch) for m in pubs)
        got = [e for m in pubs for e in m.events]
        await late.start()
        snapshot = await late.request("monitor", QueryEvents(), expect=EventSnapshot)
        for actor in [late, *reversed(actors)]:
            await actor.stop()
        return got, snapshot

    got, snapshot = run_virtual(main)
    on_file = [
        msgspec.json.Decoder(EventRecord).decode(line) for line in path.read_bytes().splitlines()
    ]
    # every record went to the file, and to the live watcher, in the same order
    assert on_file == got
    assert on_file[0] == DeviceMap(
        t=0.0,
        roles={0: "rollout", 1: "reward", 2: "training"},
        replicas={0: "r0", 1: "m0", 2: "trainer"},
    )

    def of(kind):
        return [r for r in on_file if isinstance(r, kind)]

    assert [p.phase for p in of(JobPhase)] == ["running"]
    assert of(JobPhase)[0].steps == 4 and of(JobPhase)[0].deployment == "pivot"
    maps = of(DeviceMap)
    assert maps[-1].roles == {0: "reward", 1: "reward", 2: "training"}
    assert maps[-1].replicas == {0: "m1", 1: "m0", 2: "trainer"}
    shift_phases = [(s.txn, s.phase) for s in of(ShiftPhase) if s.txn == 3]
    assert shift_phases == [(3, "started"), (3, "aborted"), (3, "acquired"), (3, "done")]
    assert of(ShiftPhase)[0].devices == [0]
    (decision,) = of(PlannerDecision)
    assert (decision.bottleneck, decision.acted, decision.value) == ("reward", True, 550.0)
    assert [(t.phase, t.version) for t in of(TrainerPhase)] == [("training", 3)]
    rates = of(RoleRate)
    assert rates and all((r.role, r.running, r.queued) == ("rollout", 2, 3) for r in rates)
    assert any(r.tokens_per_s > 0 for r in rates)
    assert [s.step for s in of(StepDone)] == [0, 1, 2, 3]
    assert of(StepDone)[3].report["seconds"] == 5.0
    assert of(ActorRestarted)[0].actor == "agent-0"
    assert sorted(a.kind for a in of(Alert)) == [
        "restart",
        "reward_failures",
        "slow_shift",
        "slow_step",
    ]

    # the late joiner: the latest of each state, the recent history
    state = {type(r): r for r in snapshot.state}
    assert state[DeviceMap] == maps[-1]
    assert state[TrainerPhase].phase == "training"
    assert state[PlannerDecision] == decision
    assert state[JobPhase].phase == "running"
    assert state[RoleRate] == rates[-1]
    assert [s.step for s in snapshot.history if isinstance(s, StepDone)] == [0, 1, 2, 3]
    assert sum(isinstance(r, Alert) for r in snapshot.history) == 4
    assert snapshot.events == len(on_file)


def test_start_up_names_what_it_waits_for_once_per_change():
    hub = EventHub(0.0, steps=2)
    hub.expect_children(
        0.0, [("loading models", ["agent-0", "agent-1"]), ("building DeepSpeed", ["trainer"])]
    )
    for t, child in enumerate(["rollout-scheduler", "agent-0", "agent-1", "trainer"], start=1):
        hub.supervised(SupervisorEvent(float(t), child, "started"))
    details = [(r.t, r.detail) for r in hub.flush() if isinstance(r, JobPhase)]
    assert details == [
        (0.0, "loading models (0/2 up)"),
        (2.0, "loading models (1/2 up)"),
        (3.0, "building DeepSpeed (0/1 up)"),
    ]


def _stopped_job(tmp_path, now: bool):

    job = JobConfig(steps=50, rollout=RolloutSection(prompts_per_step=2, samples_per_prompt=2))

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        actors, _, driver = _cluster(bus, job, replicas=1, trainer=True)
        driver.checkpoints = Checkpoints(tmp_path, last_step=job.steps - 1)
        operator = Actor("operator", bus)
        for actor in (*actors, driver, operator):
            await actor.start()
        while not driver.reports:
            await clock.sleep(0.1)
        accepted = await operator.request("driver", StopJob(now=now), expect=StopAccepted)
        await driver.finished.wait()
        for actor in (operator, driver, *reversed(actors)):
            await actor.stop()
        return accepted, [r.step for r in driver.reports], driver.reports[-1]

    return run_virtual(main)


def test_a_stopped_job_finishes_its_step_with_a_checkpoint(tmp_path):
    accepted, steps, last = _stopped_job(tmp_path, now=False)
    assert accepted.step >= 1 and steps == list(range(accepted.step + 1)) and steps[-1] < 49
    assert last.checkpoint == accepted.checkpoint
    assert (tmp_path / f"step-{accepted.step:06d}" / "state.json").is_file()


def test_stop_now_abandons_the_step(tmp_path):
    accepted, steps, last = _stopped_job(tmp_path, now=True)
    assert (accepted.step, accepted.checkpoint) == (-1, "")
    assert last.checkpoint is None and steps == [0]  # the step in progress never reported
    assert not list(tmp_path.glob("step-*"))
