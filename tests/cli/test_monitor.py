"""pivot monitor: the screen against a recorded events.jsonl and against a job's event stream
(a fake Monitor publishing on an inproc:// bus), driven with Textual's Pilot."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

import demo_run
import msgspec
import pytest

from pivot.bus import Actor, Bus, Directory, Message, handles
from pivot.cli.event_sources import LiveSource, MemorySource, ReplaySource, Wire
from pivot.cli.main import main as pivot_main
from pivot.cli.monitor import BadRun, newest_run, open_source
from pivot.cli.monitor_app import MonitorApp, draw_lanes
from pivot.events import EVENTS_FILE, DeviceMap, EventRecord, JobPhase, StepDone

SIZE = (80, 24)


def write_events(run_dir, events) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.json.Encoder()
    (run_dir / EVENTS_FILE).write_bytes(b"".join(encoder.encode(e) + b"\n" for e in events))


def lanes_text(app: MonitorApp) -> list[str]:
    return draw_lanes(app.view, 40, 0).plain.splitlines()


def header(app: MonitorApp) -> str:
    return app.header_text()


@pytest.fixture
def recorded(tmp_path):
    run_dir = tmp_path / "runs" / "demo"
    write_events(run_dir, demo_run.events())
    return run_dir


async def test_a_replay_shows_the_roles_its_events_say(recorded):
    app = MonitorApp(ReplaySource(recorded / EVENTS_FILE), run_name="demo")
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        lanes = lanes_text(app)
        assert [line.split()[:3] for line in lanes] == [
            ["0", "rollout", "rollout@0"],
            ["1", "reward", "reward@1"],
            ["2", "reward", "reward@2"],
            ["3", "rollout", "rollout@3"],
        ]
        # device 3 served training, then rollout from the lend on: its lane shows both
        assert "░" in lanes[3] and lanes[3].endswith("█")
        assert header(app) == "demo │ finished │ step 5/5 │ 0:41 │ ⏸ replay │ 2 alerts"


async def test_replay_keys_move_time_and_a_shift_moves_a_lane(recorded):
    app = MonitorApp(ReplaySource(recorded / EVENTS_FILE), run_name="demo")
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.press("home")
        assert app.cursor == 0 and not app.view.lanes
        await pilot.press("right")  # the first moment: the job starts
        assert "starting: loading models" in header(app)
        await pilot.press("pagedown")  # just after step 0
        assert app.view.steps_done == 1 and app.view.t == 8.0
        assert app.view.lanes[1].role == "rollout"
        await pilot.press("right", "right", "right")  # 8.5, 10 (shift starts), 11 (drained)
        assert app.view.t == 11.0 and app.view.shifts[1].phase == "drained"
        assert "⇄" in lanes_text(app)[1]  # the device in flight is marked
        await pilot.press("pagedown")  # just after step 1: the shift is done
        assert app.view.lanes[1].role == "reward" and "⇄" not in lanes_text(app)[1]
        await pilot.press("left")
        assert app.view.t < 16.0
        await pilot.press("pageup")  # back to just after step 0
        assert app.view.steps_done == 1 and app.view.t == 8.0
        await pilot.press("end")
        assert app.cursor == len(app.events) and app.view.phase == "finished"


async def test_play_runs_the_replay_from_the_start_and_stops_at_the_end():
    # the play timer never fires here: the test advances run time itself
    app = MonitorApp(MemorySource(demo_run.events()), run_name="demo", play_tick_s=3600.0)
    async with app.run_test(size=SIZE) as pilot:
        await app.workers.wait_for_complete()
        await pilot.press("space")  # at the end: plays from the start
        assert app.playing and app.cursor == 0 and "▶ replay" in header(app)
        app.advance(12.0)  # what the play timer does, by run time, not by the wall clock
        assert app.view.t == 12.0 and app.view.lanes[1].role == "rollout"
        await pilot.press("space")
        assert not app.playing and "⏸ replay" in header(app)
        await pilot.press("space")
        app.advance(1000.0)
        assert not app.playing and app.cursor == len(app.events)


# -- live: a fake Monitor on an inproc:// bus


class EventBatch(Message):
    events: list[EventRecord]


class QueryEvents(Message):
    pass


class EventSnapshot(Message):  # as pivot.actors.messages spells it on the events branch
    state: list[EventRecord]
    history: list[EventRecord]
    events: int = 0


WIRE = Wire(topic="events", batch=EventBatch, query=QueryEvents, snapshot=EventSnapshot)


class FakeMonitor(Actor):
    def __init__(self, name, bus, snapshot) -> None:
        super().__init__(name, bus)
        self.snapshot = snapshot
        self.asked: list[str] = []

    @handles
    def query(self, msg: QueryEvents) -> EventSnapshot:
        self.asked.append(type(msg).__name__)
        # the device map and the job's phase as state, the rest as history
        state = [e for e in self.snapshot if isinstance(e, DeviceMap | JobPhase)]
        history = [e for e in self.snapshot if not isinstance(e, DeviceMap | JobPhase)]
        return EventSnapshot(state=state, history=history, events=len(self.snapshot))


async def test_a_late_joiner_catches_up_from_the_snapshot_then_follows_the_stream():
    events = demo_run.events()
    before = [e for e in events if e.t <= 12.0]  # what happened before the watcher came
    after = [e for e in events if e.t > 10.0]  # a batch overlapping the snapshot
    directory = Directory.inproc(["monitor", "watcher"], namespace=uuid.uuid4().hex)
    bus = Bus.nng(directory, WIRE.messages)
    monitor = FakeMonitor("monitor", bus, before)
    await monitor.start()
    try:
        source = LiveSource(Actor("watcher", bus), WIRE, monitor="monitor")
        app = MonitorApp(source, run_name="live")
        async with app.run_test(size=SIZE) as pilot:
            while not app.loaded:
                await pilot.pause(0.01)
            assert app.view.t == 12.0 and app.view.shifts[1].phase == "drained"
            assert app.view.lanes[1].role == "rollout" and "LIVE" in header(app)
            mid = [e for e in after if e.t <= 20.0]
            await monitor.publish(WIRE.topic, EventBatch(events=mid))
            while app.view.t < 20.0:
                await pilot.pause(0.01)
            assert app.view.lanes[1].role == "reward"  # the shift moved the lane
            # the overlap was dropped: each event once
            assert len(app.events) == len([e for e in events if e.t <= 20.0])
            await monitor.publish(WIRE.topic, EventBatch(events=[e for e in after if e.t > 20]))
            while app.live:
                await pilot.pause(0.01)
            assert header(app) == "live │ finished │ step 5/5 │ 0:41 │ ⏸ replay │ 2 alerts"
            await pilot.press("q")
        assert monitor.asked == ["QueryEvents"]  # leaving tells the job nothing
    finally:
        await monitor.stop()
        await bus.close()


async def test_a_watcher_starts_from_the_record_and_ends_with_it_when_the_job_ends(tmp_path):
    events = demo_run.events()
    record = tmp_path / EVENTS_FILE
    write_events(tmp_path, [e for e in events if e.t <= 8.0])  # flushed so far
    directory = Directory.inproc(["monitor", "watcher"], namespace=uuid.uuid4().hex)
    bus = Bus.nng(directory, WIRE.messages)
    # the snapshot: the latest state and only the recent history
    monitor = FakeMonitor("monitor", bus, [e for e in events if 6.0 < e.t <= 12.0])
    await monitor.start()
    over = False
    try:
        source = LiveSource(
            Actor("watcher", bus),
            WIRE,
            monitor="monitor",
            record=record,
            ended=lambda: over,
            poll_s=0.02,
        )
        app = MonitorApp(source, run_name="live")
        async with app.run_test(size=SIZE) as pilot:
            while not app.loaded:
                await pilot.pause(0.01)
            # the whole run so far, each event once: the lanes start at the job's start
            assert app.events == [e for e in events if e.t <= 12.0]
            assert app.view.lanes[0].spans[0][0] == 2.0
            # the job ends; its last batch never came, its record holds everything
            write_events(tmp_path, events)
            over = True
            while app.live:
                await pilot.pause(0.01)
            assert app.events == events and app.view.phase == "finished"
    finally:
        await monitor.stop()
        await bus.close()


async def test_a_job_is_reached_through_its_job_file_over_its_ipc_bus(tmp_path):
    from pivot.actors.assembly import MONITOR

    sockets = tempfile.mkdtemp(prefix="pm-")  # short: ipc paths have a length limit
    names = [MONITOR, "driver"]
    bus = Bus.nng(Directory.ipc(sockets, names), WIRE.messages)
    monitor = FakeMonitor(MONITOR, bus, demo_run.events())
    await monitor.start()
    try:
        info = {"pid": os.getpid(), "state": "running", "sockets": sockets, "names": names}
        app = MonitorApp(LiveSource.of_job(info, wire=WIRE), run_name="job")
        async with app.run_test(size=SIZE) as pilot:
            while not app.loaded:
                await pilot.pause(0.01)
            assert app.view.lanes[3].role == "rollout" and app.view.phase == "finished"
    finally:
        await monitor.stop()
        await bus.close()
        shutil.rmtree(sockets, ignore_errors=True)


async def test_a_job_that_does_not_answer_is_said_on_the_header(monkeypatch):
    from pivot.cli import event_sources

    monkeypatch.setattr(event_sources, "SNAPSHOT_TIMEOUT_S", 0.2)
    directory = Directory.inproc(["monitor", "watcher"], namespace=uuid.uuid4().hex)
    bus = Bus.nng(directory, WIRE.messages)  # nobody serves "monitor"
    try:
        app = MonitorApp(LiveSource(Actor("watcher", bus), WIRE, monitor="monitor"))
        async with app.run_test(size=SIZE) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert "stream lost" in header(app) and not app.live
    finally:
        await bus.close()


# -- the command


def test_a_bad_run_dir_is_one_line_and_exit_2(tmp_path, capsys):
    assert pivot_main(["monitor", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pivot monitor: {tmp_path / 'nope'}: no such run folder"]
    (tmp_path / "empty").mkdir()
    assert pivot_main(["monitor", str(tmp_path / "empty")]) == 2
    assert "no events.jsonl and no running job" in capsys.readouterr().err


def test_the_default_run_is_the_newest_and_an_ended_job_is_replayed(tmp_path):
    with pytest.raises(BadRun):
        newest_run(tmp_path / "runs")
    older, newer = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    write_events(older, [JobPhase(t=0.0, phase="finished")])
    write_events(newer, [StepDone(t=1.0, step=0, report={})])
    os.utime(older, (1, 1))
    assert newest_run(tmp_path / "runs") == newer
    (newer / "job.json").write_text('{"state": "finished", "pid": 1}')
    assert isinstance(open_source(newer), ReplaySource)


def test_a_running_job_without_an_event_stream_is_replayed_from_its_file(tmp_path, monkeypatch):
    from pivot.cli import event_sources

    def no_stream():
        raise event_sources.NoEventStream("no EventBatch")

    monkeypatch.setattr(event_sources, "job_wire", no_stream)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    info = {"pid": os.getpid(), "state": "running", "sockets": str(tmp_path), "names": []}
    (run_dir / "job.json").write_text(json.dumps(info))
    with pytest.raises(BadRun, match="no events.jsonl"):
        open_source(run_dir)
    write_events(run_dir, demo_run.events())
    assert isinstance(open_source(run_dir), ReplaySource)
