"""Supervision: restarts with backoff, escalation, child processes that never outlive
their supervisor."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pivot.bus import (
    Actor,
    Bus,
    BusError,
    Directory,
    RequestTimeout,
    RestartPolicy,
    Supervisor,
    SupervisorEscalation,
    Unreachable,
    VirtualClock,
    run_real,
    run_virtual,
    started,
)
from pivot.bus.statsfile import read_stats_dir
from pivot.bus.supervisor import Launcher
from pivot.bus.testing import TESTING_MESSAGES, Crash, Echo, EchoActor
from pivot.bus.testing import process_alive as alive
from pivot.bus.zygote import ZygoteLauncher


class Flaky(Actor):
    """Crashes ``lifetime`` seconds after it starts."""

    lifetime = 1.0

    async def run(self) -> None:
        await self.clock.sleep(self.lifetime)
        raise RuntimeError("flaky")


def timeline(supervisor: Supervisor, child: str) -> list[tuple[float, str]]:
    return [(e.at, e.event) for e in supervisor.events if e.child == child]


def test_crashes_are_restarted_with_backoff_then_escalated() -> None:
    async def main(clock: VirtualClock) -> tuple[Supervisor, Exception, bool]:
        bus = Bus.local(TESTING_MESSAGES, clock=clock)
        policy = RestartPolicy(max_restarts=3, window=60.0, backoff=0.5, backoff_factor=2.0)
        supervisor = Supervisor(clock=clock, policy=policy)
        supervisor.add_actor("steady", lambda: EchoActor("steady", bus))
        supervisor.add_actor("flaky", lambda: Flaky("flaky", bus))
        with pytest.raises(SupervisorEscalation) as caught:
            await supervisor.run(handle_signals=False)
        steady = supervisor.actor("steady")
        return supervisor, caught.value, steady is not None and steady.running

    supervisor, escalation, steady_running = run_virtual(main)
    assert timeline(supervisor, "flaky") == [
        (0.0, "started"),
        (1.0, "crashed"),
        (1.0, "restarting"),  # after 0.5 s
        (1.5, "started"),
        (2.5, "crashed"),
        (2.5, "restarting"),  # after 1.0 s
        (3.5, "started"),
        (4.5, "crashed"),
        (4.5, "restarting"),  # after 2.0 s
        (6.5, "started"),
        (7.5, "crashed"),
        (7.5, "escalated"),
        (7.5, "stopped"),
    ]
    assert escalation.child == "flaky" and escalation.restarts == 3
    assert "flaky" in escalation.failure
    assert timeline(supervisor, "steady")[-1] == (7.5, "stopped")  # everything was stopped
    assert not steady_running


def test_crashes_further_apart_than_the_window_never_escalate() -> None:
    class SlowFlaky(Flaky):
        lifetime = 100.0

    async def main(clock: VirtualClock) -> Supervisor:
        bus = Bus.local(TESTING_MESSAGES, clock=clock)
        supervisor = Supervisor(
            clock=clock, policy=RestartPolicy(max_restarts=2, window=60.0, backoff=0.5)
        )
        supervisor.add_actor("flaky", lambda: SlowFlaky("flaky", bus))
        await supervisor.start()
        await clock.sleep(1000.0)
        await supervisor.stop()
        await supervisor.wait()  # stopped cleanly: no escalation
        return supervisor

    supervisor = run_virtual(main)
    assert supervisor.restarts("flaky") == 9
    delays = [e.detail for e in supervisor.events if e.event == "restarting"]
    assert delays == ["in 0.5 s"] * 9  # the window forgot each earlier crash


def test_restarted_actor_serves_again() -> None:
    async def main(clock: VirtualClock) -> tuple[str, bool, int]:
        bus = Bus.local(TESTING_MESSAGES, clock=clock)
        supervisor = Supervisor(clock=clock, policy=RestartPolicy(backoff=2.0))
        supervisor.add_actor("echo", lambda: EchoActor("echo", bus))
        async with started(Actor("client", bus)) as (client,):
            await supervisor.start()
            first = supervisor.actor("echo")
            await client.request("echo", Crash(), timeout=1)
            await clock.sleep(0.1)
            with pytest.raises(Unreachable):  # crashed, waiting out its backoff
                await client.request("echo", Echo(text="too early"), timeout=1)
            await clock.sleep(2.0)
            reply = await client.request("echo", Echo(text="back"), timeout=1)
            replaced = supervisor.actor("echo") is not first
            await supervisor.stop()
        return reply.text, replaced, supervisor.restarts("echo")

    assert run_virtual(main) == ("back", True, 1)


# -- child processes


def wait_until_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


SUPERVISOR_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from pivot.bus import Directory, Supervisor, configure_logging
    from pivot.bus.zygote import ZygoteLauncher

    async def main():
        configure_logging("warning")
        directory = Directory.ipc(sys.argv[1], ["a", "b"])
        forking = sys.argv[2] == "zygote"
        supervisor = Supervisor(launcher=ZygoteLauncher(["pivot.bus.testing"]) if forking else None)
        for name in ("a", "b"):
            supervisor.add_process(
                name, "pivot.bus.testing:echo_actor", kwargs={"directory": directory.to_dict()}
            )
        supervisor.install_signal_handlers()
        try:
            await supervisor.start()
            server = [supervisor.launcher.pid] if forking else []
            print("PIDS", supervisor.pid("a"), supervisor.pid("b"), *server, flush=True)
            await supervisor.wait()
        finally:
            await supervisor.stop()
        print("CLEAN EXIT", flush=True)

    asyncio.run(main())
    """
)


SupervisorProcess = tuple[subprocess.Popen[str], list[int], Path]


@pytest.fixture(params=["exec", "zygote"])
def supervisor_process(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SupervisorProcess]:
    """A supervisor process and its two children (each exec'd, or forked from its fork server:
    then the server's pid is the third)."""
    folder = tmp_path_factory.mktemp("sup")
    script = folder / "supervise.py"
    script.write_text(SUPERVISOR_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), str(folder), request.param], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("PIDS"), f"supervisor said {line!r}"
    pids = [int(p) for p in line.split()[1:]]
    yield process, pids, folder
    if process.poll() is None:
        process.kill()
        process.wait()
    for pid in pids:  # never leave strays behind, whatever the test did
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


async def test_sigterm_to_the_supervisor_stops_every_child(
    supervisor_process: SupervisorProcess,
) -> None:
    process, pids, folder = supervisor_process
    assert all(alive(p) for p in pids)
    bus = Bus.nng(Directory.ipc(folder, ["a", "b", "probe"]), TESTING_MESSAGES)
    async with started(Actor("probe", bus)) as (probe,):
        for name in ("a", "b"):  # the children really serve
            assert (await probe.request(name, Echo(text=name), timeout=5)).by == name
    await bus.close()
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=20)
    assert process.returncode == 0
    assert "CLEAN EXIT" in out
    assert wait_until_gone(pids, 0.5) == []  # gone by the time the supervisor exited


def test_children_die_with_a_killed_supervisor(supervisor_process: SupervisorProcess) -> None:
    process, pids, _ = supervisor_process
    process.kill()  # SIGKILL: no chance to clean up; PR_SET_PDEATHSIG must do it
    process.wait()
    assert wait_until_gone(pids) == []


async def test_crashed_child_process_is_restarted(
    tmp_path_factory: pytest.TempPathFactory, launcher
) -> None:
    directory = Directory.ipc(tmp_path_factory.mktemp("ipc"), ["echo", "probe"])
    supervisor = Supervisor(policy=RestartPolicy(backoff=0.05), launcher=launcher())
    supervisor.add_process(
        "echo", "pivot.bus.testing:echo_actor", kwargs={"directory": directory.to_dict()}
    )
    bus = Bus.nng(directory, TESTING_MESSAGES)
    await supervisor.start()
    try:
        first_pid = supervisor.pid("echo")
        async with started(Actor("probe", bus)) as (probe,):
            await probe.request("echo", Crash(), timeout=5)
            for _ in range(400):  # the old process exits, the supervisor starts a new one
                if timeline(supervisor, "echo")[-1][1] == "started" and supervisor.restarts("echo"):
                    break
                await asyncio.sleep(0.05)
            reply = None
            for _ in range(100):  # nng redials the new process in the background
                try:
                    reply = await probe.request("echo", Echo(text="again"), timeout=0.5)
                    break
                except (Unreachable, RequestTimeout):
                    await asyncio.sleep(0.05)
            assert reply is not None and reply.text == "again"
            assert supervisor.pid("echo") != first_pid
            assert supervisor.restarts("echo") == 1
            assert not alive(first_pid)
    finally:
        await supervisor.stop()
        await bus.close()
    assert not alive(supervisor.pid("echo"))


def chatty_echo(name: str, *, directory: dict):
    """An echo actor whose factory prints to stdout first, as DeepSpeed does."""
    print("a library says hello on stdout", flush=True)
    from pivot.bus.testing import echo_actor

    return echo_actor(name, directory=directory)


@pytest.fixture(params=["exec", "zygote"])
def launcher(request: pytest.FixtureRequest) -> Callable[[], Launcher | None]:
    """Makes a supervisor's launcher: each child exec'd (None: the default), or forked from a
    fork server."""
    if request.param == "exec":
        return lambda: None
    return lambda: ZygoteLauncher(["pivot.bus.testing"])


def test_child_printing_before_ready_still_starts(tmp_path, launcher):
    directory = Directory.ipc(tmp_path, ["chatty", "client"])

    async def main():
        sup = Supervisor(launcher=launcher())
        sup.add_process(
            "chatty",
            "test_bus_supervisor:chatty_echo",
            kwargs={"directory": directory.to_dict()},
            env={"PYTHONPATH": str(Path(__file__).parent)},
            ready_timeout=60.0,
        )
        await sup.start()
        try:
            client = Actor("client", Bus.nng(directory, TESTING_MESSAGES))
            await client.start()
            reply = await client.request("chatty", Echo(text="hi"), timeout=10.0)
            assert reply.text == "hi"
            await client.stop()
        finally:
            await sup.stop()

    run_real(main())


async def test_a_child_says_why_it_died_before_and_after_ready(tmp_path_factory, launcher) -> None:
    """The cause reaches the supervisor in one line (the child's FAILED line), not only the
    child's log: an actor that cannot be made, and one that crashes while it runs."""
    directory = Directory.ipc(tmp_path_factory.mktemp("ipc"), ["broken", "echo", "probe"])
    early = Supervisor(policy=RestartPolicy(restart="never"), launcher=launcher())
    early.add_process(
        "broken",
        "pivot.bus.testing:unmakeable_actor",
        kwargs={"directory": directory.to_dict(), "error": "model.safetensors: header too large"},
    )
    with pytest.raises(BusError) as err:
        await early.start()
    assert "before it was ready: ValueError: model.safetensors: header too large" in str(err.value)
    await early.stop()

    stats_dir = tmp_path_factory.mktemp("bus")
    late = Supervisor(
        policy=RestartPolicy(restart="never"), stats_dir=stats_dir, launcher=launcher()
    )
    late.add_process(
        "echo", "pivot.bus.testing:echo_actor", kwargs={"directory": directory.to_dict()}
    )
    bus = Bus.nng(directory, TESTING_MESSAGES)
    await late.start()
    try:
        async with started(Actor("probe", bus)) as (probe,):
            await bus.transport.request("echo", b"\xc1 not msgpack", 5.0)  # a known rejection
            await probe.request("echo", Crash(), timeout=5)
            with pytest.raises(SupervisorEscalation) as escalated:
                await asyncio.wait_for(late.wait(), 30)
    finally:
        await late.stop()
        await bus.close()
    text = str(escalated.value)
    assert "child 'echo' failed (exit code 1: RuntimeError: crash requested)" in text
    assert "is not restarted" in text and "again" not in text
    # the crashed child still wrote its final bus counters, under its name
    record = read_stats_dir(stats_dir)["echo"]
    assert record.final and record.actors["echo"]["decode_errors"] == 1
    assert record.actors["echo"]["requests_served"] == 1  # the Crash


def test_sighup_stops_everything_and_the_handler_from_before_comes_back() -> None:
    def before(signum: int, frame: object) -> None:
        raise AssertionError("the supervisor's handler should have taken SIGHUP")

    async def main(clock: object) -> Supervisor:
        bus = Bus.local(TESTING_MESSAGES)
        supervisor = Supervisor()
        supervisor.add_actor("echo", lambda: EchoActor("echo", bus))
        supervisor.install_signal_handlers()
        try:
            await supervisor.start()
            signal.raise_signal(signal.SIGHUP)
            async with asyncio.timeout(30):  # a guard against a hang, not a measurement
                await supervisor.wait()
        finally:
            supervisor.remove_signal_handlers()
        return supervisor

    saved = signal.signal(signal.SIGHUP, before)
    try:
        supervisor = run_real(main)  # uvloop, as pivot run
        assert signal.getsignal(signal.SIGHUP) is before
    finally:
        signal.signal(signal.SIGHUP, saved)
    assert supervisor.signalled is signal.SIGHUP
    assert timeline(supervisor, "echo")[-1][1] == "stopped"


def test_a_signal_ignored_before_stays_ignored() -> None:
    async def main(clock: object) -> Supervisor:
        supervisor = Supervisor()
        supervisor.add_actor("echo", lambda: EchoActor("echo", Bus.local(TESTING_MESSAGES)))
        supervisor.install_signal_handlers()
        try:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # nohup: the job goes on
            await supervisor.start()
        finally:
            await supervisor.stop()
            supervisor.remove_signal_handlers()
        return supervisor

    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        run_real(main)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, saved)


async def test_a_group_restarts_as_one_and_escalates_naming_the_member(tmp_path_factory) -> None:
    """Process children of one group (a trainer's ranks) live and die together: one that
    crashes takes the others down, all start again, one restart counted for the group; past
    its budget the escalation names the group and the member that died."""
    directory = Directory.ipc(tmp_path_factory.mktemp("ipc"), ["a", "b", "probe"])
    supervisor = Supervisor(policy=RestartPolicy(max_restarts=1, backoff=0.05))
    for name in ("b", "a"):
        supervisor.add_process(
            name,
            "pivot.bus.testing:echo_actor",
            kwargs={"directory": directory.to_dict()},
            group="a",
        )
    bus = Bus.nng(directory, TESTING_MESSAGES)
    await supervisor.start()
    try:
        first = {n: supervisor.pid(n) for n in ("a", "b")}
        async with started(Actor("probe", bus)) as (probe,):
            await probe.request("b", Crash(), timeout=5)
            for _ in range(400):
                if timeline(supervisor, "a")[-1][1] == "started" and supervisor.restarts("a"):
                    break
                await asyncio.sleep(0.05)
            assert [e for _, e in timeline(supervisor, "a")] == [
                "started",
                "crashed",
                "restarting",
                "started",
            ]
            assert not alive(first["a"]) and not alive(first["b"])  # a went down with b
            for name in ("a", "b"):  # both serve again, in new processes
                reply = None
                for _ in range(100):
                    try:
                        reply = await probe.request(name, Echo(text=name), timeout=0.5)
                        break
                    except (Unreachable, RequestTimeout):
                        await asyncio.sleep(0.05)
                assert reply is not None and reply.text == name
                assert supervisor.pid(name) not in (None, first[name])
            await probe.request("a", Crash(), timeout=5)
            with pytest.raises(SupervisorEscalation) as escalated:
                await asyncio.wait_for(supervisor.wait(), 30)
    finally:
        await supervisor.stop()
        await bus.close()
    assert "child 'a' failed 2 times within 60 s (the last: a: exit code 1" in str(escalated.value)
    assert not alive(supervisor.pid("a")) and not alive(supervisor.pid("b"))


async def test_children_that_started_together_stop_together(tmp_path_factory) -> None:
    """Consecutive process children start side by side; they stop side by side too (each
    spends a moment tearing down), not one after another's exit."""
    folder = tmp_path_factory.mktemp("meet")
    names = ["a", "b", "c"]
    directory = Directory.ipc(folder, names)
    supervisor = Supervisor()
    for name in names:
        others = [n for n in names if n != name]
        kwargs = {"directory": directory.to_dict(), "folder": str(folder), "others": others}
        supervisor.add_process(
            name, "pivot.bus.testing:meet_on_stop", kwargs={**kwargs, "wait_s": 5.0}
        )
    await supervisor.start()
    await supervisor.stop()
    assert sorted(p.name for p in folder.glob("*.met")) == ["a.met", "b.met", "c.met"]
    stopped = [e.child for e in supervisor.events if e.event == "stopped"]
    assert stopped == ["c", "b", "a"]  # reported last started first, as before


def echo_with_teardown_marker(name: str, *, directory: dict, marker: str):
    """An echo actor whose process would touch ``marker`` in the interpreter's teardown."""
    import atexit

    from pivot.bus.testing import echo_actor

    atexit.register(Path(marker).touch)
    return echo_actor(name, directory=directory)


async def test_a_stopped_child_exits_at_once_without_the_interpreters_teardown(tmp_path) -> None:
    """Once its actor has stopped, a child flushes its logs and exits 0 without the
    teardown (which costs a process with torch loaded ~0.4 s of CPU)."""
    directory = Directory.ipc(tmp_path, ["echo"])
    marker = tmp_path / "teardown-ran"
    supervisor = Supervisor()
    supervisor.add_process(
        "echo",
        "test_bus_supervisor:echo_with_teardown_marker",
        kwargs={"directory": directory.to_dict(), "marker": str(marker)},
        env={"PYTHONPATH": str(Path(__file__).parent)},
    )
    await supervisor.start()
    process = supervisor._children["echo"].process  # (its exit status)
    await supervisor.stop()
    assert process.returncode == 0
    assert not marker.exists()
