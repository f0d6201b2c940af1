"""The Scheduler's per-sequence destinations and session hints, in-process on the virtual
clock: each completion goes to its Work's ``reply_to`` or to ``downstream``; a reply_to that
is gone costs its own completions only; a session's next turn lands on its replica."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import structlog

from pivot.actors.agent import Inline, RoleAgent
from pivot.actors.messages import (
    Ack,
    Assign,
    Completed,
    EndSession,
    QueryStatus,
    RegisterReplica,
    SchedulerStatus,
    SubmitSequences,
    Work,
)
from pivot.actors.scheduler import Scheduler
from pivot.actors.shift_messages import RegisterReplicas, RemoveReplica, ReplicaRemoved
from pivot.actors.testing import ScriptedEngine
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
from pivot.bus.clock import Clock
from pivot.cluster import Role
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import TextCodec
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, check_ownership, make_router
from pivot.retry import RetryBudget

CODEC = TextCodec.char()


def engine() -> ScriptedEngine:
    """Answers every prompt with "ok" then eos, one token per step."""
    return ScriptedEngine(
        lambda prompt, sampling: [*CODEC.encode("ok", bos=False), CODEC.eos_id],
        eos_token_ids=[CODEC.eos_id],
    )


class Inbox(Actor):
    """Keeps the sequence ids, replicas and queue waits of every completion delivered to it."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.replicas: dict[int, str] = {}
        self.queued_s: dict[int, float] = {}

    @handles
    def completed(self, msg: Completed) -> Ack:
        self.replicas.update((c.seq_id, c.replica) for c in msg.completions)
        self.queued_s.update((c.seq_id, c.queued_s) for c in msg.completions)
        return Ack(count=len(msg.completions))


def scheduler(bus: Bus, **kw) -> Scheduler:
    # round robin: without a hint, consecutive sequences go to different replicas
    router = make_router(
        RouterSettings(policy="round_robin", max_concurrent_per_replica=8),
        CostModel(a=1e-7, b=1e-3, c=5e-5, d=5e-4),
    )
    return Scheduler("sched", bus, role=Role.ROLLOUT, router=router, downstream="driver", **kw)


def agent(bus: Bus, name: str, eng: ScriptedEngine | None = None) -> RoleAgent:
    return RoleAgent(
        name, bus, engine=eng or engine(), role="rollout", scheduler="sched", stepping=Inline()
    )


def work(seq_id: int, **kw) -> Work:
    return Work(seq_id=seq_id, prompt_ids=CODEC.encode("1+1="), sampling=SamplingParams(), **kw)


async def until(clock: Clock, done: Callable[[], bool], within_s: float = 120.0) -> None:
    waited = 0.0
    while not done():
        assert waited < within_s, "timed out (virtual clock)"
        await clock.sleep(0.1)
        waited += 0.1


def test_each_destination_gets_its_own_and_a_gone_reply_to_stops_nothing():
    stream = io.StringIO()
    configure_logging("warning", json=True, stream=stream)

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        budget = RetryBudget(attempts=3, backoff_s=1.0, max_backoff_s=1.0)
        sched = scheduler(bus, delivery_retries=budget)
        driver, user, client = Inbox("driver", bus), Inbox("user", bus), Actor("client", bus)
        actors = [sched, driver, user, client, agent(bus, "agent-0"), agent(bus, "agent-1")]
        for actor in actors:
            await actor.start()
        to = ["", "user", "gone", "", "user", "gone", "driver"]
        works = [work(i, reply_to=r) for i, r in enumerate(to)]
        await client.request("sched", SubmitSequences(sequences=works))
        await until(clock, lambda: sched.undeliverable == 2)
        # the scheduler lives on: later sequences still reach downstream
        await client.request("sched", SubmitSequences(sequences=[work(7)]))
        await until(clock, lambda: 7 in driver.replicas)
        status = await client.request("sched", QueryStatus(), expect=SchedulerStatus)
        check_ownership(sched.core.ledger, sched.core)
        failure = sched.failure
        for actor in reversed(actors):
            await actor.stop()
        return set(driver.replicas), set(user.replicas), status, failure

    try:
        downstream, user, status, failure = run_virtual(main)
    finally:
        structlog.reset_defaults()
    assert failure is None
    assert downstream == {0, 3, 6, 7} and user == {1, 4}
    assert status.completed == 8 and status.undeliverable == 2
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    errors = [line for line in lines if line["level"] == "error"]
    assert len(errors) == 1  # one line for the batch, after the budget, not one per attempt
    assert errors[0]["destination"] == "gone" and errors[0]["sequences"] == 2


def test_a_completion_says_how_long_its_sequence_waited_in_the_queue_before_its_dispatch():
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        sched = scheduler(bus)
        driver, client = Inbox("driver", bus), Actor("client", bus)
        actors = [sched, driver, client]
        for actor in actors:
            await actor.start()
        # no replica yet: both wait until one registers 5 s later
        await client.request("sched", SubmitSequences(sequences=[work(0), work(1)]))
        await clock.sleep(5.0)
        actors.append(agent(bus, "agent-0"))
        await actors[-1].start()
        await until(clock, lambda: {0, 1} <= set(driver.replicas))
        await client.request("sched", SubmitSequences(sequences=[work(2)]))  # a replica is free
        await until(clock, lambda: 2 in driver.replicas)
        for actor in reversed(actors):
            await actor.stop()
        return driver.queued_s

    queued = run_virtual(main)
    assert 5.0 <= queued[0] < 5.5 and 5.0 <= queued[1] < 5.5
    assert queued[2] < 0.1


def test_a_requeued_sequence_keeps_its_reply_to():
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        sched = scheduler(bus)
        stuck = engine()
        stuck.stalled = True  # runs nothing: the sequence is still there when its replica goes
        first = agent(bus, "agent-0", stuck)
        user, client = Inbox("user", bus), Actor("client", bus)
        actors = [sched, user, client, first]
        for actor in actors:
            await actor.start()
        await client.request("sched", SubmitSequences(sequences=[work(0, reply_to="user")]))
        await until(clock, lambda: bool(first.held_sequences))
        actors.append(agent(bus, "agent-1"))
        await actors[-1].start()
        removed = await client.request(
            "sched", RemoveReplica(replica="agent-0"), expect=ReplicaRemoved
        )
        await until(clock, lambda: 0 in user.replicas)
        for actor in reversed(actors):
            await actor.stop()
        return removed.requeued, user.replicas

    requeued, delivered = run_virtual(main)
    assert requeued == 1 and delivered == {0: "agent-1"}


def test_a_sessions_next_turn_lands_on_the_replica_of_its_last():
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        sched = scheduler(bus)
        driver, client = Inbox("driver", bus), Actor("client", bus)
        actors = [sched, driver, client, agent(bus, "agent-0"), agent(bus, "agent-1")]
        for actor in actors:
            await actor.start()
        await until(clock, lambda: len(sched.routes) == 2)
        turns = []
        # each turn after the first would go to the other replica by round robin's turn
        for seq_id in range(3):
            await client.request("sched", SubmitSequences(sequences=[work(seq_id, session="chat")]))
            await until(clock, lambda: seq_id in driver.replicas)  # noqa: B023 - awaited here
            turns.append(driver.replicas[seq_id])
        ended = await client.request("sched", EndSession(session="chat"), expect=Ack)
        status = await client.request("sched", QueryStatus(), expect=SchedulerStatus)
        for actor in reversed(actors):
            await actor.stop()
        return turns, ended.count, status

    turns, ended, status = run_virtual(main)
    assert len(set(turns)) == 1
    assert (status.session_hits, status.session_misses) == (2, 0)
    assert ended == 1


def test_a_resent_submission_runs_once_and_another_sequence_under_its_id_is_refused():
    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        sched = scheduler(bus)
        driver, client = Inbox("driver", bus), Actor("client", bus)
        actors = [sched, driver, client, agent(bus, "agent-0")]
        for actor in actors:
            await actor.start()
        # the first reply was lost: the Driver's Calls send the same sequences again
        for _ in range(2):
            await client.request("sched", SubmitSequences(sequences=[work(0), work(1)]))
        other = Work(seq_id=1, prompt_ids=CODEC.encode("2+2="), sampling=SamplingParams())
        try:
            await client.request("sched", SubmitSequences(sequences=[other]))
        except RemoteError as exc:
            refused = str(exc)
        else:
            refused = ""
        await until(clock, lambda: len(driver.replicas) == 2)
        await clock.sleep(5.0)
        status = await client.request("sched", QueryStatus(), expect=SchedulerStatus)
        for actor in reversed(actors):
            await actor.stop()
        return status, refused

    status, refused = run_virtual(main)
    assert status.completed == 2
    assert "ids [1]" in refused


def test_a_registration_again_requeues_only_what_another_agent_process_lost():
    # a registration again (a restarted Controller's, from an Acquire's reply) may say what
    # the agent held before its latest Assign: only another process of the agent (another
    # incarnation) has lost what the scheduler placed there
    stream = io.StringIO()
    configure_logging("warning", json=True, stream=stream)

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        sched = scheduler(bus)
        stuck = engine()
        stuck.stalled = True  # the sequences stay where they were placed
        first = agent(bus, "agent-0", stuck)
        client = Actor("client", bus)
        for actor in (sched, client, first):
            await actor.start()
        await client.request("sched", SubmitSequences(sequences=[work(0), work(1)]))
        await until(clock, lambda: len(first.held_sequences) == 2)
        requeued = []
        for incarnation in (first.incarnation, first.incarnation + 1):
            again = RegisterReplica(
                replica="agent-0",
                agent="agent-0",
                role="rollout",
                max_running=8,
                held=[],
                agent_incarnation=incarnation,
            )
            await client.request("sched", again)
            lines = [json.loads(line) for line in stream.getvalue().splitlines()]
            requeued.append(
                sum(
                    line["sequences"]
                    for line in lines
                    if line["event"] == "requeued what a restarted agent lost"
                )
            )
        for actor in (first, client, sched):
            await actor.stop()
        return requeued

    try:
        requeued = run_virtual(main)
    finally:
        structlog.reset_defaults()
    assert requeued == [0, 2]


class Holds(Actor):
    """An agent that keeps what it is assigned and runs none of it."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.held: list[int] = []

    @handles
    def assign(self, msg: Assign) -> Ack:
        self.held += [w.seq_id for w in msg.sequences]
        return Ack()


def placed_on_two_new_replicas(together: bool) -> list[int]:
    """Eight queued sequences, then two replicas of cap 8 registered one after the other or
    in one RegisterReplicas: how many each holds."""

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        sched = scheduler(bus)
        client = Actor("client", bus)
        agents = [Holds(f"agent-{i}", bus) for i in range(2)]
        for actor in (sched, client, *agents):
            await actor.start()
        await client.request("sched", SubmitSequences(sequences=[work(i) for i in range(8)]))
        joins = [
            RegisterReplica(replica=a.name, agent=a.name, role="rollout", max_running=8)
            for a in agents
        ]
        if together:
            await client.request("sched", RegisterReplicas(replicas=joins))
        else:
            for join in joins:
                await client.request("sched", join)
        await until(clock, lambda: sum(len(a.held) for a in agents) == 8)
        for actor in (*agents, client, sched):
            await actor.stop()
        return [len(a.held) for a in agents]

    return run_virtual(main)


def test_replicas_registered_together_share_the_queue_where_the_first_alone_takes_it():
    # a shift's wakes join their scheduler in one message: registered one by one, the first
    # fills to its cap with the whole queue before the second is known
    assert placed_on_two_new_replicas(together=False) == [8, 0]
    assert placed_on_two_new_replicas(together=True) == [4, 4]
