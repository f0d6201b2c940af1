"""Which policy version sampled which tokens, as agents report it: a weight load while a
sequence runs splits its chunks there, and a sequence moved to another replica keeps the
chunks of the first one. A scheduler, scripted engines and gated stepping on the local
transport and the virtual clock, so that the token count at each event is the test's choice."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pivot.actors.agent import Inline, RoleAgent, WeightLoader
from pivot.actors.messages import Ack, Completed, Completion, SubmitSequences, Work
from pivot.actors.scheduler import Scheduler
from pivot.actors.shift_messages import MigrateSequences, SequenceMigration
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Actor, Bus, Clock, LocalTransport, handles, run_virtual
from pivot.cluster import Role
from pivot.engines.protocol import InferenceEngine, SamplingParams
from pivot.engines.scripted import ScriptedEngine
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, make_router
from pivot.trajectory import Chunk

OUTPUT = list(range(10, 30))  # every sequence's whole output: 20 tokens


class Gated(Inline):
    """One engine step per permit (``allow``), so a test knows each sequence's token count."""

    def __init__(self) -> None:
        super().__init__()
        self._permits = asyncio.Semaphore(0)

    def allow(self, steps: int) -> None:
        for _ in range(steps):
            self._permits.release()

    async def turn(self, agent: RoleAgent, engine: InferenceEngine) -> None:
        await self._permits.acquire()
        await super().turn(agent, engine)


class Sink(Actor):
    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.completions: dict[int, Completion] = {}

    @handles
    def completed(self, msg: Completed) -> Ack:
        self.completions.update((c.seq_id, c) for c in msg.completions)
        return Ack(count=len(msg.completions))


def _engine(version: int = 0) -> ScriptedEngine:
    return ScriptedEngine(lambda prompt, sampling: OUTPUT, weights_version=version)


def _work(seq_id: int, policy_version: int = 0) -> Work:
    return Work(
        seq_id=seq_id,
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=len(OUTPUT)),
        policy_version=policy_version,
    )


def _policy(version: int) -> WeightLoader:
    return lambda model, min_version: ({}, max(version, min_version))


async def _start(clock: Clock) -> tuple[Bus, Sink, Scheduler, Actor]:
    """The bus, a rollout scheduler delivering to a sink, and a client."""
    bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
    router = make_router(
        RouterSettings(policy="lowest_itl", max_concurrent_per_replica=8),
        CostModel(a=1e-7, b=1e-3, c=5e-5, d=5e-4),
    )
    sink = Sink("sink", bus)
    scheduler = Scheduler("sched", bus, role=Role.ROLLOUT, router=router, downstream="sink")
    client = Actor("client", bus)
    for actor in (sink, scheduler, client):
        await actor.start()
    return bus, sink, scheduler, client


async def _agent(
    bus: Bus, name: str, engine: ScriptedEngine, stepping: Gated, loader: WeightLoader | None = None
) -> RoleAgent:
    """A rollout agent of replica ``name``, registered with the scheduler."""
    agent = RoleAgent(
        name,
        bus,
        engine=engine,
        role="rollout",
        scheduler="sched",
        weights={"rollout": loader} if loader is not None else None,
        stepping=stepping,
    )
    await agent.start()
    return agent


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0)


def test_a_weight_load_mid_sequence_closes_its_chunk_at_the_tokens_sampled_so_far():
    async def main(clock):
        engine, gate = _engine(0), Gated()
        bus, sink, scheduler, client = await _start(clock)
        agent = await _agent(bus, "a", engine, gate, _policy(1))
        await client.request("sched", SubmitSequences(sequences=[_work(0)]))
        gate.allow(3)
        await _until(lambda: engine.stats().steps == 3)
        # a sequence of policy 1 makes the agent load it while sequence 0 runs
        await client.request("sched", SubmitSequences(sequences=[_work(1, policy_version=1)]))
        await _until(lambda: engine.stats().weights_version == 1)
        gate.allow(100)
        await _until(lambda: len(sink.completions) == 2)
        for actor in (agent, client, scheduler, sink):
            await actor.stop()
        return sink.completions

    done = run_virtual(main)
    assert done[0].token_ids == OUTPUT
    assert done[0].chunks == [Chunk(3, 0), Chunk(len(OUTPUT) - 3, 1)]
    assert done[1].chunks == [Chunk(len(OUTPUT), 1)]


def test_a_moved_sequence_keeps_the_first_replicas_chunk_and_adds_the_seconds():
    async def main(clock):
        first, gate = _engine(0), Gated()
        second, open_gate = _engine(2), Gated()
        open_gate.allow(100)
        bus, sink, scheduler, client = await _start(clock)
        a = await _agent(bus, "a", first, gate)
        await client.request("sched", SubmitSequences(sequences=[_work(0)]))
        gate.allow(4)
        await _until(lambda: first.stats().steps == 4)
        b = await _agent(bus, "b", second, open_gate)
        moved = await client.request(
            "sched", MigrateSequences(migrations=[SequenceMigration(0, "a", "b")]), expect=Ack
        )
        assert moved.count == 1
        await _until(lambda: bool(second.added))  # the Assign follows the reply
        carried = second.added[-1]
        await _until(lambda: len(sink.completions) == 1)
        for actor in (b, a, client, scheduler, sink):
            await actor.stop()
        return sink.completions[0], carried

    done, carried = run_virtual(main)
    assert carried == (0, 4)  # the second replica re-prefilled the first one's 4 tokens
    assert done.token_ids == OUTPUT and done.replica == "b"
    assert done.chunks == [Chunk(4, 0), Chunk(len(OUTPUT) - 4, 2)]
