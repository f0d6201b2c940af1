"""The fork server (``pivot.bus.zygote``): a child forked from it is the child an exec would
have started (its environment, working directory, session, death signal), with the server's
modules already imported; its exits reach the supervisor; and where the server cannot serve
(a preload that leaves a thread, a server that died) children start by exec instead."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from pivot.bus import Actor, Bus, Directory, RestartPolicy, Supervisor, run_real, started
from pivot.bus.testing import TESTING_MESSAGES, Echo, echo_actor, process_alive
from pivot.bus.zygote import ZygoteLauncher

HERE = str(Path(__file__).parent)


def record_start(name: str, *, directory: dict, out: str) -> Actor:
    """An echo actor whose factory first writes what its process is: run in the child."""
    Path(out).write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "sid": os.getsid(0),
                "cwd": os.getcwd(),
                "mark": os.environ.get("PIVOT_TEST_MARK"),
                "preloaded": "colorsys" in sys.modules,
            }
        )
    )
    return echo_actor(name, directory=directory)


def start_a_thread() -> None:
    """A preload that leaves a thread running (a fork would copy only its caller)."""
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


async def _serving(probe: Actor, name: str) -> str:
    for _ in range(200):  # nng redials a restarted child in the background
        try:
            return (await probe.request(name, Echo(text="hi"), timeout=0.5)).by
        except Exception:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never answered")


async def _restarted(supervisor: Supervisor, name: str, before: int) -> int:
    for _ in range(300):
        pid = supervisor.pid(name)
        if pid not in (None, before) and supervisor.restarts(name) == 1:
            return pid
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} was not restarted: {list(supervisor.events)[-4:]}")


async def test_a_forked_child_is_the_child_exec_makes_with_the_servers_modules(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    directory = Directory.ipc(tmp_path, ["echo", "probe"])
    launcher = ZygoteLauncher(["colorsys"])
    supervisor = Supervisor(launcher=launcher)
    out = tmp_path / "start.json"
    supervisor.add_process(
        "echo",
        "test_bus_zygote:record_start",
        kwargs={"directory": directory.to_dict(), "out": str(out)},
        env={"PYTHONPATH": HERE, "PIVOT_TEST_MARK": "marked"},
    )
    await supervisor.start()
    bus = Bus.nng(directory, TESTING_MESSAGES)
    try:
        async with started(Actor("probe", bus)) as (probe,):
            assert await _serving(probe, "echo") == "echo"
        child = json.loads(out.read_text())
        assert child["pid"] == supervisor.pid("echo")
        assert child["ppid"] == launcher.pid and launcher.refused is None  # forked, not exec'd
        assert child["sid"] == child["pid"]  # its own session: the supervisor signals its group
        assert child["cwd"] == str(tmp_path) and child["mark"] == "marked"
        assert child["preloaded"]
    finally:
        await supervisor.stop()
        await bus.close()
    assert not process_alive(child["pid"])
    for _ in range(100):  # the server ends once its launcher closed
        if not process_alive(launcher.pid):
            break
        await asyncio.sleep(0.02)
    assert not process_alive(launcher.pid)


async def test_a_preload_that_leaves_a_thread_makes_children_start_by_exec(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", HERE)  # the server's, to import this module
    directory = Directory.ipc(tmp_path, ["echo", "probe"])
    out = tmp_path / "start.json"
    launcher = ZygoteLauncher(["test_bus_zygote:start_a_thread"])
    supervisor = Supervisor(launcher=launcher)
    supervisor.add_process(
        "echo",
        "test_bus_zygote:record_start",
        kwargs={"directory": directory.to_dict(), "out": str(out)},
    )
    await supervisor.start()
    bus = Bus.nng(directory, TESTING_MESSAGES)
    try:
        async with started(Actor("probe", bus)) as (probe,):
            assert await _serving(probe, "echo") == "echo"
        assert json.loads(out.read_text())["ppid"] == os.getpid()  # exec'd by this process
        assert launcher.refused is not None and "2 threads after the preload" in launcher.refused
    finally:
        await supervisor.stop()
        await bus.close()


async def test_the_children_of_a_dead_server_come_back_by_exec(tmp_path) -> None:
    directory = Directory.ipc(tmp_path, ["echo", "probe"])
    out = tmp_path / "start.json"
    launcher = ZygoteLauncher(["pivot.bus.testing"])
    supervisor = Supervisor(launcher=launcher, policy=RestartPolicy(backoff=0.05))
    supervisor.add_process(
        "echo",
        "test_bus_zygote:record_start",
        kwargs={"directory": directory.to_dict(), "out": str(out)},
        env={"PYTHONPATH": HERE},
    )
    await supervisor.start()
    bus = Bus.nng(directory, TESTING_MESSAGES)
    try:
        first = supervisor.pid("echo")
        assert json.loads(out.read_text())["ppid"] == launcher.pid
        os.kill(launcher.pid, signal.SIGKILL)
        await _restarted(supervisor, "echo", first)
        assert not process_alive(first)  # it died with its server
        async with started(Actor("probe", bus)) as (probe,):
            assert await _serving(probe, "echo") == "echo"
        assert json.loads(out.read_text())["ppid"] == os.getpid()
        assert launcher.refused == "the fork server exited"
    finally:
        await supervisor.stop()
        await bus.close()


async def test_a_cpu_job_forks_its_children_with_its_models_modules_and_a_cuda_job_execs_them():
    from pivot.actors.processes import PRELOAD, job_launcher
    from pivot.assets import ASSETS
    from pivot.bus.supervisor import ExecLauncher
    from pivot.cluster import Role

    checkpoints = {Role.ROLLOUT: ASSETS / "tiny-policy", Role.REWARD: ASSETS / "tiny-genrm"}
    for accelerator, engine in (("cuda", "torch"), ("cpu", "sglang")):
        assert isinstance(job_launcher(accelerator, engine, checkpoints), ExecLauncher)
    launcher = job_launcher("cpu", "torch", checkpoints)
    try:
        assert isinstance(launcher, ZygoteLauncher) and launcher.pid is not None  # begun
        # both tiny models are qwen2: the trainer's transformers module, once
        assert launcher.preload == [*PRELOAD, "transformers.models.qwen2.modeling_qwen2"]
    finally:
        await launcher.close()
    assert not process_alive(launcher.pid)


def _pipes() -> int:
    """This process's open pipes (an fd listed may close before it is read)."""
    found = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            found += os.readlink(fd).startswith("pipe:")
        except FileNotFoundError:
            pass
    return found


def test_a_killed_forked_child_is_reported_by_its_signal_forked_again_and_leaves_no_pipe_open(
    tmp_path,
) -> None:
    """Under uvloop, as ``pivot run``: uvloop leaves a read pipe open at EOF and closes it
    only when collected, possibly after its file object did (a second close of a number
    another file reuses), so each child's pipe must be closed when it ends."""
    directory = Directory.ipc(tmp_path, ["echo", "probe"])

    async def main() -> tuple[int, int]:
        before = _pipes()
        launcher = ZygoteLauncher(["pivot.bus.testing"])
        supervisor = Supervisor(launcher=launcher, policy=RestartPolicy(backoff=0.05))
        supervisor.add_process(
            "echo", "pivot.bus.testing:echo_actor", kwargs={"directory": directory.to_dict()}
        )
        await supervisor.start()
        bus = Bus.nng(directory, TESTING_MESSAGES)
        try:
            first = supervisor.pid("echo")
            os.kill(first, signal.SIGKILL)
            second = await _restarted(supervisor, "echo", first)
            crashes = [e.detail for e in supervisor.events if e.event == "crashed"]
            assert crashes == ["exit code -9"]
            parent = int(Path(f"/proc/{second}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert parent == launcher.pid  # forked again
            async with started(Actor("probe", bus)) as (probe,):
                assert await _serving(probe, "echo") == "echo"
        finally:
            await supervisor.stop()
            await bus.close()
        await asyncio.sleep(0.1)
        return before, _pipes()

    before, after = run_real(main())
    assert after == before
