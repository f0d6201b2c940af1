"""Monitor: samples the run for people (live display, plot) without being in anyone's way.

It reads the agents' ``load`` publications (cumulative token counters, so a dropped
publication costs resolution, not tokens) and polls each scheduler's status for outstanding
sequences, and every ``interval`` seconds emits one ``RoleSample`` per inference role.
"""

from __future__ import annotations

from collections.abc import Callable

from pivot.actors.messages import QueryStatus, ReplicaLoad, SchedulerStatus
from pivot.bus import Actor, Bus, BusError
from pivot.timeline import RateMeter, RoleSample


class Monitor(Actor):
    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        agents: list[str],
        schedulers: dict[str, str],
        on_sample: Callable[[list[RoleSample]], None] | None = None,
        interval: float = 0.5,
        origin: float = 0.0,
    ) -> None:
        super().__init__(name, bus)
        self.agents = agents
        self.schedulers = schedulers  # role -> scheduler actor
        self.on_sample = on_sample
        self.interval = interval
        self.origin = origin  # sample times are seconds since this clock reading
        self.samples: list[RoleSample] = []
        self.meter = RateMeter()

    async def run(self) -> None:
        loads = self.subscribe("load", publishers=self.agents)
        self.meter.sample(self.clock.now())
        while True:
            await self.clock.sleep(self.interval)
            for pub in loads.drain():
                if isinstance(pub.message, ReplicaLoad):
                    m = pub.message
                    self.meter.observe(m.replica, m.role, m.generated_tokens)
            now = self.clock.now()
            rates = self.meter.sample(now)
            batch = []
            for role, scheduler in self.schedulers.items():
                try:
                    status = await self.request(
                        scheduler, QueryStatus(), expect=SchedulerStatus, timeout=self.interval * 4
                    )
                    outstanding = status.queued + status.running
                except BusError:
                    continue  # a busy scheduler costs a sample, never the run
                batch.append(
                    RoleSample(
                        t=now - self.origin,
                        role=role,
                        tokens_per_s=rates.get(role, 0.0),
                        outstanding=outstanding,
                    )
                )
            self.samples.extend(batch)
            if self.on_sample is not None and batch:
                self.on_sample(batch)
