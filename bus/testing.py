"""Small actors and factories that tests (and users checking a deployment) share,
as ``trio.testing`` ships with trio: an echo server, one that notes whether its siblings
were stopping with it, and factories that child processes started by the ``Supervisor``
can import."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from pivot.bus.actor import Actor, Bus, handles
from pivot.bus.codec import Message
from pivot.bus.transport import Directory


class Echo(Message):
    """Request: the reply carries the same text back."""

    text: str


class Echoed(Message):
    text: str
    by: str


class Fail(Message):
    """Request: the handler raises ``RuntimeError(text)``."""

    text: str


class Crash(Message):
    """Request: the actor crashes (its main loop raises) right after replying."""


TESTING_MESSAGES = (Echo, Echoed, Fail, Crash)


class EchoActor(Actor):
    """Echoes ``Echo``, raises on ``Fail``, crashes on ``Crash``."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.seen: list[str] = []

    @handles
    def echo(self, msg: Echo, sender: str) -> Echoed:
        self.seen.append(msg.text)
        return Echoed(text=msg.text, by=self.name)

    @handles
    def fail(self, msg: Fail) -> None:
        raise RuntimeError(msg.text)

    @handles
    async def crash(self, msg: Crash) -> None:
        self.spawn(self._crash_soon(), name="crash")

    async def _crash_soon(self) -> None:
        await self.clock.sleep(0)
        raise RuntimeError("crash requested")


def echo_actor(name: str, *, directory: dict[str, Any], secret_env: str | None = None) -> EchoActor:
    """Factory for ``Supervisor.add_process(name, "pivot.bus.testing:echo_actor", ...)``:
    an ``EchoActor`` on nng, with the shared secret read from ``secret_env`` if given."""
    secret = os.environ[secret_env] if secret_env else None
    bus = Bus.nng(Directory.from_dict(directory), TESTING_MESSAGES, secret=secret)
    return EchoActor(name, bus)


def unmakeable_actor(name: str, *, directory: dict[str, Any], error: str) -> EchoActor:
    """Factory for a child whose actor cannot be made (as an agent whose checkpoint is
    corrupt): raises ``ValueError(error)``."""
    raise ValueError(error)


class MeetOnStop(EchoActor):
    """When stopped, marks ``<folder>/<name>.stopping`` and waits (up to ``wait_s``) until
    each of ``others`` has marked its own, then ``<name>.met``: children stopped together
    all meet, one stopped only after another has exited does not."""

    def __init__(
        self, name: str, bus: Bus, *, folder: str, others: list[str], wait_s: float
    ) -> None:
        super().__init__(name, bus)
        self.folder, self.others, self.wait_s = Path(folder), others, wait_s

    async def on_stop(self) -> None:
        (self.folder / f"{self.name}.stopping").touch()
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            if all((self.folder / f"{o}.stopping").exists() for o in self.others):
                (self.folder / f"{self.name}.met").touch()
                return
            await asyncio.sleep(0.02)


def meet_on_stop(
    name: str, *, directory: dict[str, Any], folder: str, others: list[str], wait_s: float
) -> MeetOnStop:
    """Factory for ``Supervisor.add_process``: a ``MeetOnStop`` on nng."""
    bus = Bus.nng(Directory.from_dict(directory), TESTING_MESSAGES)
    return MeetOnStop(name, bus, folder=folder, others=others, wait_s=wait_s)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, not yet reaped, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
