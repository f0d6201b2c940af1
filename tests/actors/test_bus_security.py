"""Bind policy: non-loopback addresses need a shared secret; tcp works with port 0."""

from __future__ import annotations

import pytest

from pivot.bus import (
    Actor,
    Bus,
    Directory,
    Endpoint,
    InsecureBindError,
    RequestTimeout,
    check_bind_address,
    started,
)
from pivot.bus.errors import AddressError
from pivot.bus.testing import TESTING_MESSAGES, Echo, EchoActor


@pytest.mark.parametrize(
    "address",
    [
        "ipc:///tmp/x.rep",
        "inproc://x",
        "tcp://127.0.0.1:5555",
        "tcp://127.9.9.9:1",
        "tcp://localhost:1",
        "tcp://[::1]:1",
    ],
)
def test_local_addresses_need_no_secret(address: str) -> None:
    check_bind_address(address, secured=False)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://0.0.0.0:5555",
        "tcp://10.1.2.3:5555",
        "tcp://*:5555",
        "tcp://example.com:1",
        "tcp://[::]:1",
    ],
)
def test_other_addresses_are_refused_without_a_secret(address: str) -> None:
    with pytest.raises(InsecureBindError) as caught:
        check_bind_address(address, secured=False)
    assert caught.value.address == address
    assert address in str(caught.value)
    check_bind_address(address, secured=True)


def test_malformed_addresses_are_named() -> None:
    with pytest.raises(AddressError, match="bad bus address 'http://x'"):
        check_bind_address("http://x", secured=True)
    with pytest.raises(AddressError, match="ipc path"):
        Directory.ipc("/tmp/" + "d" * 120, ["a"])


async def test_actor_refuses_insecure_bind_and_binds_nothing() -> None:
    directory = Directory({"open": Endpoint(rep="tcp://0.0.0.0:0", pub="tcp://0.0.0.0:0")})
    actor = Actor("open", Bus.nng(directory, TESTING_MESSAGES))
    with pytest.raises(InsecureBindError, match=r"tcp://0\.0\.0\.0:0"):
        await actor.start()
    assert not actor.running
    assert directory.lookup("open").rep == "tcp://0.0.0.0:0"  # no port was taken
    await actor.bus.close()


async def test_tcp_with_secret_and_port_zero() -> None:
    directory = Directory(
        {
            "server": Endpoint(rep="tcp://0.0.0.0:0", pub="tcp://0.0.0.0:0"),
            "client": Endpoint(rep="tcp://127.0.0.1:0", pub="tcp://127.0.0.1:0"),
            "intruder": Endpoint(rep="tcp://127.0.0.1:0", pub="tcp://127.0.0.1:0"),
        }
    )
    bus = Bus.nng(directory, TESTING_MESSAGES, secret="s3cret")
    intruder_bus = Bus.nng(directory, TESTING_MESSAGES)  # loopback: allowed without secret
    server, client = EchoActor("server", bus), Actor("client", bus)
    intruder = Actor("intruder", intruder_bus)
    async with started(server, client, intruder):
        port = int(directory.lookup("server").rep.rsplit(":", 1)[1])
        assert port > 0  # the directory learned the bound port
        assert (await client.request("server", Echo(text="over tcp"), timeout=5)).text == "over tcp"
        with pytest.raises(RequestTimeout):
            await intruder.request("server", Echo(text="unsigned"), timeout=0.3)
        assert server.stats.bad_hmac == 1
        assert server.seen == ["over tcp"]
    await bus.close()
    await intruder_bus.close()
