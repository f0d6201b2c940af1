"""pivot monitor's screen at fixed sizes, from the deterministic demo run (SVG snapshots:
``pytest tests/cli --snapshot-update`` rewrites them after an intended change of layout)."""

from __future__ import annotations

import demo_run

from pivot.cli.event_sources import MemorySource
from pivot.cli.monitor_app import MonitorApp


def app() -> MonitorApp:
    return MonitorApp(MemorySource(demo_run.events()), run_name="demo", play_tick_s=3600.0)


async def loaded(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_the_end_of_a_run_at_80x24(snap_compare):
    assert snap_compare(app(), terminal_size=(80, 24), run_before=loaded)


def test_the_end_of_a_run_at_120x40(snap_compare):
    assert snap_compare(app(), terminal_size=(120, 40), run_before=loaded)


def test_a_shift_in_flight_at_80x24(snap_compare):
    # just after step 0, then three moments on: device 1 is draining for the reward role
    keys = ("home", "pagedown", "right", "right", "right")
    assert snap_compare(app(), terminal_size=(80, 24), run_before=loaded, press=keys)
