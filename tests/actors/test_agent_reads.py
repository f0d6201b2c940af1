"""Where an agent runs its weights read on Acquire: a small one on its loop, a large one (or
one of unknown size, a file) in a worker thread (``Threaded`` stepping, the real engines')."""

from __future__ import annotations

import asyncio
import threading

from pivot.actors.agent import SMALL_READ_BYTES, RoleAgent, Threaded
from pivot.actors.shift_messages import Acquire, AgentState
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Actor, Bus, LocalTransport
from pivot.cluster import Role
from pivot.engines.scripted import ScriptedEngine


class ThreadOfRead:
    """A loader that notes the thread each read ran on; ``read_bytes`` as given."""

    def __init__(self, read_bytes: int | None) -> None:
        self.read_bytes = read_bytes
        self.threads: list[int] = []

    def __call__(self, model: str, min_version: int) -> tuple[dict, int]:
        self.threads.append(threading.get_ident())
        return {}, min_version


def test_a_small_weights_read_runs_on_the_agents_loop_a_large_one_in_a_thread():
    async def main():
        bus = Bus.local(rl_messages(), transport=LocalTransport())
        small, large = ThreadOfRead(3 << 20), ThreadOfRead(SMALL_READ_BYTES + 1)
        unknown = ThreadOfRead(None)  # (a file to read)
        agents = [
            RoleAgent(
                f"agent-{d}",
                bus,
                device=d,
                engines={"rollout": ScriptedEngine(lambda prompt, sampling: [1], max_running=4)},
                weights={"rollout": loader},
                stepping=Threaded(),
            )
            for d, loader in enumerate((small, large, unknown))
        ]
        client = Actor("client", bus)
        for actor in (*agents, client):
            await actor.start()
        for d in range(3):
            acquire = Acquire(role=Role.ROLLOUT, replica=f"rollout@{d}", devices=[d])
            await client.request(f"agent-{d}", acquire, expect=AgentState)
        loop = threading.get_ident()
        assert small.threads == [loop]
        assert len(large.threads) == 1 and large.threads != [loop]
        assert len(unknown.threads) == 1 and unknown.threads != [loop]
        for actor in (client, *agents):
            await actor.stop()

    asyncio.run(main())
