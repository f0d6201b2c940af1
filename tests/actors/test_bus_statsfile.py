"""A process's bus counters in a file: written at start, every interval of the bus clock and
at exit, atomically, with every actor instance made on the bus."""

from __future__ import annotations

import json
from pathlib import Path

from pivot.bus import Actor, Bus, VirtualClock, run_virtual, started
from pivot.bus.statsfile import BusStatsFile, read_stats_dir, trouble
from pivot.bus.testing import TESTING_MESSAGES, Echo, EchoActor


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_file_holds_known_drops_rewritten_each_interval_and_at_exit(tmp_path) -> None:
    path = tmp_path / "bus" / "main.json"

    async def main(clock: VirtualClock) -> list[dict]:
        bus = Bus.local(TESTING_MESSAGES, clock=clock)
        seen = []
        async with BusStatsFile(bus, path, process="main", interval=10.0):
            seen.append(read(path))  # written at once: nothing counted yet
            async with started(EchoActor("server", bus), Actor("client", bus)) as (_, client):
                subscription = client.subscribe("news", maxlen=1)
                for text in "abc":  # a queue of one: the two oldest are dropped
                    await client.publish("news", Echo(text=text))
                assert len(subscription) == 1
                await bus.transport.request("server", b"\xc1 not msgpack", 5.0)
                await clock.sleep(10.5)
                seen.append(read(path))
            # a second instance of the same actor (a restart): counted under the same name
            async with started(EchoActor("server", bus)):
                await bus.transport.request("server", b"\xc1 not msgpack", 5.0)
        seen.append(read(path))
        return seen

    at_start, periodic, final = run_virtual(main)
    assert at_start["actors"] == {} and at_start["final"] is False
    assert periodic["final"] is False
    assert periodic["actors"]["client"]["dropped_publications"] == 2
    assert periodic["actors"]["server"]["decode_errors"] == 1
    assert final["final"] is True and final["process"] == "main"
    assert final["actors"]["server"]["decode_errors"] == 2
    assert final["actors"]["server"]["error_replies"] == 2
    assert final["totals"]["published"] == 3
    assert [p.name for p in path.parent.iterdir()] == ["main.json"]  # no temporary file left
    records = read_stats_dir(path.parent)
    assert list(records) == ["main"]
    assert trouble(records) == {"dropped_publications": 2, "decode_errors": 2, "error_replies": 2}
