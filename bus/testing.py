"""Small actors and factories that tests (and users checking a deployment) share,
as ``trio.testing`` ships with trio: an echo server, and factories that child
processes started by the ``Supervisor`` can import."""

from __future__ import annotations

import os
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
