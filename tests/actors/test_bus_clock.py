"""Virtual time: jumps to the next timer, deterministic event order, deadlock detection."""

from __future__ import annotations

import asyncio

import pytest

from pivot.bus import (
    Actor,
    Bus,
    BusError,
    Directory,
    Message,
    RealClock,
    RequestTimeout,
    VirtualClock,
    VirtualDeadlock,
    handles,
    run_real,
    run_virtual,
    started,
)


class Job(Message):
    id: int
    size: float


class JobDone(Message):
    id: int
    worker: str


class Load(Message):
    worker: str
    busy: int


MESSAGES = (Job, JobDone, Load)
EventLog = list[tuple[float, str, str]]


class Worker(Actor):
    """Takes jobs, works on them for a random time, publishes its load every 5 s."""

    def __init__(self, name: str, bus: Bus, log: EventLog) -> None:
        super().__init__(name, bus)
        self.events = log
        self.busy = 0

    @handles
    async def job(self, msg: Job, sender: str) -> JobDone:
        self.busy += 1
        self.events.append((self.clock.now(), self.name, f"start {msg.id} from {sender}"))
        await self.clock.sleep(msg.size * (0.5 + self.clock.rng.random()))
        self.busy -= 1
        self.events.append((self.clock.now(), self.name, f"done {msg.id}"))
        return JobDone(id=msg.id, worker=self.name)

    async def run(self) -> None:
        while True:
            await self.clock.sleep(5.0)
            await self.publish("load", Load(worker=self.name, busy=self.busy))


class Dispatcher(Actor):
    """Sends jobs at random intervals to the least loaded worker it has heard of."""

    def __init__(self, name: str, bus: Bus, log: EventLog, workers: list[str]) -> None:
        super().__init__(name, bus)
        self.events = log
        self.load = dict.fromkeys(workers, 0)

    async def run(self) -> None:
        self.spawn(self.watch_load(), name="watch")
        next_id = 0
        while True:
            await self.clock.sleep(self.clock.rng.expovariate(1.5))
            next_id += 1
            worker = min(self.load, key=lambda w: (self.load[w], w))
            self.spawn(self.send(worker, next_id))

    async def send(self, worker: str, job_id: int) -> None:
        size = self.clock.rng.uniform(0.5, 4.0)
        try:
            done = await self.request(
                worker, Job(id=job_id, size=size), timeout=3.0, expect=JobDone
            )
            self.events.append((self.clock.now(), self.name, f"ack {done.id} by {done.worker}"))
        except RequestTimeout:
            self.events.append((self.clock.now(), self.name, f"timeout {job_id}"))

    async def watch_load(self) -> None:
        async for publication in self.subscribe("load"):
            self.load[publication.sender] = publication.message.busy
            self.events.append((self.clock.now(), self.name, f"load {publication.sender}"))


async def ten_minutes(clock: VirtualClock) -> EventLog:
    log: EventLog = []
    bus = Bus.local(MESSAGES, clock=clock)
    names = ["w0", "w1", "w2"]
    workers = [Worker(n, bus, log) for n in names]
    dispatcher = Dispatcher("dispatcher", bus, log, names)
    async with started(*workers, dispatcher):
        await clock.sleep(600.0)
    log.append((clock.now(), "main", "end"))
    return log


def test_ten_minute_scenario_replays_identically() -> None:
    first = run_virtual(ten_minutes, seed=42)
    second = run_virtual(ten_minutes, seed=42)
    assert first == second
    assert first[-1] == (600.0, "main", "end")
    kinds = {entry.split()[0] for _, _, entry in first}
    assert kinds >= {"start", "done", "ack", "timeout", "load"}  # every path was exercised
    assert sum(1 for _, _, e in first if e.startswith("ack")) > 500
    times = [t for t, _, _ in first]
    assert times == sorted(times)


def test_another_seed_gives_another_history() -> None:
    assert run_virtual(ten_minutes, seed=1) != run_virtual(ten_minutes, seed=2)


def test_sleep_jumps_exactly_to_the_timer() -> None:
    async def main(clock: VirtualClock) -> list[float]:
        seen = []
        for delay in (3600.0, 0.25, 1e-3):
            await clock.sleep(delay)
            seen.append(clock.now())
        return seen

    assert run_virtual(main) == [3600.0, 3600.25, 3600.251]


def test_timers_due_at_one_instant_run_in_the_order_they_were_set() -> None:
    # other timers, cancelled or not, change the heap's layout but not that order (with
    # asyncio's own heap of TimerHandles, which compare only their time, they do)
    async def main(clock: VirtualClock) -> list[int]:
        loop = asyncio.get_running_loop()
        ran: list[int] = []
        for i in range(60):
            loop.call_at(5.0, ran.append, i)
            other = loop.call_at(clock.rng.uniform(0.0, 10.0), lambda: None)
            if i % 3 == 0:
                other.cancel()
        await clock.sleep(6.0)
        return ran

    for seed in range(3):
        assert run_virtual(main, seed=seed) == list(range(60))


def test_the_loop_jumps_no_timer_past_run_until_complete() -> None:
    clock = VirtualClock()
    clock.loop.call_later(50.0, lambda: None)

    async def main() -> float:
        await asyncio.sleep(2.0)
        return clock.now()

    assert clock.loop.run_until_complete(main()) == 2.0
    assert clock.now() == 2.0  # the timer at 50 s is still pending, not run
    clock.loop.close()


def test_request_timeout_fires_at_virtual_deadline() -> None:
    class Sleeper(Actor):
        @handles
        async def job(self, msg: Job) -> JobDone:
            await self.clock.sleep(100.0)
            return JobDone(id=msg.id, worker=self.name)

    async def main(clock: VirtualClock) -> float:
        bus = Bus.local(MESSAGES, clock=clock)
        async with started(Sleeper("sleeper", bus), Actor("caller", bus)) as (_, caller):
            start = clock.now()
            with pytest.raises(RequestTimeout):
                await caller.request("sleeper", Job(id=1, size=1.0), timeout=2.5)
            return clock.now() - start

    assert run_virtual(main) == 2.5


def test_everyone_waiting_without_timers_is_a_deadlock() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualDeadlock):
        run_virtual(main())


def test_run_real_uses_uvloop_and_real_time() -> None:
    async def main(clock: RealClock) -> tuple[str, float]:
        start = clock.now()
        await clock.sleep(0.01)
        return type(asyncio.get_running_loop()).__module__, clock.now() - start

    module, elapsed = run_real(main)
    assert module.startswith("uvloop")
    assert elapsed > 0


def test_nng_transport_refuses_virtual_time() -> None:
    async def main(clock: VirtualClock) -> None:
        bus = Bus.nng(Directory.inproc(["a"], namespace="virtual-refused"), MESSAGES, clock=clock)
        with pytest.raises(BusError, match="virtual time"):
            await Actor("a", bus).start()

    run_virtual(main)
