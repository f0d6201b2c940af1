"""The local transport's fast path: a request whose handler is a plain function is served
by a loop callback, with no task and no timer of its own, in the order a task per request
would serve it, and it still times out where no reply comes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pivot.bus import Actor, Bus, LocalTransport, Message, RequestTimeout, handles, started
from pivot.bus.clock import VirtualClock, run_virtual
from pivot.bus.codec import Codec, Seal
from pivot.bus.testing import TESTING_MESSAGES, Echo, Echoed


class Nap(Message):
    seconds: float
    text: str


MESSAGES = (*TESTING_MESSAGES, Nap)


class TaskPerRequest(LocalTransport):
    """The local transport without the fast path: every request is a worker task's."""

    async def serve(self, name: str, handler: Any, **kwargs: Any) -> Any:
        kwargs.pop("triage", None)
        return await super().serve(name, handler, **kwargs)


class Recorder(Actor):
    """Two request slots; records when each request is handled."""

    concurrency = 2

    def __init__(self, name: str, bus: Bus, log: list[tuple[float, str]]) -> None:
        super().__init__(name, bus)
        self.trace = log

    @handles
    def echo(self, msg: Echo, sender: str) -> Echoed:
        self.trace.append((self.clock.now(), f"{self.name} echo {msg.text} from {sender}"))
        return Echoed(text=msg.text, by=self.name)

    @handles
    async def nap(self, msg: Nap) -> Echoed:
        self.trace.append((self.clock.now(), f"{self.name} nap {msg.text}"))
        await self.clock.sleep(msg.seconds)
        return Echoed(text=msg.text, by=self.name)


def _scenario(transport: LocalTransport) -> list[tuple[float, str]]:
    """Three clients send bursts of plain (Echo) and awaiting (Nap) requests to two
    two-slot servers, so that requests queue behind busy slots and fast and slow ones mix."""
    trace: list[tuple[float, str]] = []

    async def client(actor: Actor, k: int) -> None:
        for i in range(6):
            to = f"server{(i + k) % 2}"
            message: Any = (
                Echo(text=f"{k}.{i}") if (i + k) % 3 else Nap(seconds=0.5, text=f"{k}.{i}")
            )
            calls = [actor.request(to, message, timeout=5.0) for _ in range(1 + i % 3)]
            for reply in await asyncio.gather(*calls):
                trace.append((actor.clock.now(), f"{actor.name} got {reply.text} by {reply.by}"))
            if i % 2:
                await actor.clock.sleep(0.25)

    async def main(clock: VirtualClock) -> list[tuple[float, str]]:
        bus = Bus(transport, Codec(MESSAGES), clock)
        servers = [Recorder(f"server{j}", bus, trace) for j in range(2)]
        clients = [Actor(f"client{k}", bus) for k in range(3)]
        async with started(*servers, *clients):
            await asyncio.gather(*(client(c, k) for k, c in enumerate(clients)))
        return trace

    return run_virtual(main, seed=1)


def test_the_fast_path_serves_in_the_order_a_task_per_request_gives() -> None:
    fast, tasks = _scenario(LocalTransport()), _scenario(TaskPerRequest())
    assert any("nap" in line for _, line in fast) and any("echo" in line for _, line in fast)
    assert len(fast) == 3 * sum(1 + i % 3 for i in range(6)) * 2
    assert fast == tasks


def test_a_plain_handler_answers_with_no_task_and_no_timer() -> None:
    async def main(clock: VirtualClock) -> tuple[int, int, int, int]:
        bus = Bus.local(MESSAGES, clock=clock)
        loop = asyncio.get_running_loop()
        counts = {"tasks": 0, "timers": 0}
        create_task, call_at = loop.create_task, loop.call_at

        def counting_task(*args: Any, **kwargs: Any) -> Any:
            counts["tasks"] += 1
            return create_task(*args, **kwargs)

        def counting_timer(*args: Any, **kwargs: Any) -> Any:
            counts["timers"] += 1
            return call_at(*args, **kwargs)

        async with started(Recorder("server", bus, []), Actor("client", bus)) as (_, client):
            loop.create_task, loop.call_at = counting_task, counting_timer  # type: ignore[method-assign]
            for text in ("a", "b", "c"):
                assert (await client.request("server", Echo(text=text))).text == text
            plain = counts["tasks"], counts["timers"]
            await client.request("server", Nap(seconds=0.0, text="d"))
            awaiting = counts["tasks"] - plain[0], counts["timers"] - plain[1]
            loop.create_task, loop.call_at = create_task, call_at  # type: ignore[method-assign]
        return (*plain, *awaiting)

    # an awaiting handler still runs in a worker task, and its sender's timeout is a timer
    # (its own sleep(0) sets none)
    assert run_virtual(main) == (0, 0, 1, 1)


def test_a_request_is_decoded_once_whether_its_handler_awaits_or_not() -> None:
    async def main(clock: VirtualClock) -> list[str]:
        codec = Codec(MESSAGES)
        bus = Bus(LocalTransport(), codec, clock)
        decoded: list[str] = []
        request_of = codec.request_of

        def counting(payload: Any) -> Any:
            envelope = request_of(payload)
            decoded.append(type(envelope.body).__name__)
            return envelope

        async with started(Recorder("server", bus, []), Actor("client", bus)) as (_, client):
            codec.request_of = counting  # type: ignore[method-assign]
            assert (await client.request("server", Echo(text="a"))).text == "a"
            assert (await client.request("server", Nap(seconds=0.5, text="b"))).text == "b"
            codec.request_of = request_of  # type: ignore[method-assign]
        return decoded

    assert run_virtual(main) == ["Echo", "Nap"]


def test_a_request_the_fast_path_drops_times_out_at_its_deadline() -> None:
    async def main(clock: VirtualClock) -> float:
        transport = LocalTransport()
        codec = Codec(MESSAGES, secret="s3cret")
        bus = Bus(transport, codec, clock)
        async with started(Recorder("server", bus, [])):
            # sealed for another actor: the server admits nothing and answers nothing
            frame = codec.encode_request("client", 1, Echo(text="x"), Seal("other", 7, 1))
            start = clock.now()
            with pytest.raises(RequestTimeout):
                await transport.request("server", frame, 2.5)
            return clock.now() - start

    assert run_virtual(main) == 2.5


def test_a_request_queued_at_a_closing_server_times_out() -> None:
    async def main(clock: VirtualClock) -> float:
        transport = LocalTransport()
        codec = Codec(MESSAGES)
        server = Recorder("server", Bus(transport, codec, clock), [])
        await server.start()
        frame = codec.encode_request("client", 1, Echo(text="x"), None)
        start = clock.now()
        request = asyncio.get_running_loop().create_task(transport.request("server", frame, 3.0))
        await asyncio.sleep(0)  # submitted, its callback not run yet
        await server.stop()
        with pytest.raises(RequestTimeout):
            await request
        return clock.now() - start

    assert run_virtual(main) == 3.0
