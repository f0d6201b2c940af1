"""Security: tcp binds need the shared secret; signed frames are accepted once, by the actor
they were sealed for, and a reply only for its own request; the secret file's checks."""

from __future__ import annotations

import asyncio
import hmac
import os
import random
import struct
import uuid
from pathlib import Path

import pynng
import pytest

from pivot.bus import (
    Actor,
    Bus,
    Codec,
    Directory,
    Endpoint,
    InsecureBindError,
    LocalTransport,
    Message,
    ProtocolError,
    RequestTimeout,
    check_bind_address,
    handles,
    started,
)
from pivot.bus.clock import VirtualClock, run_virtual
from pivot.bus.codec import (
    MAC_SIZE,
    REQUEST_WINDOW,
    SECRET_ENV,
    SECRET_FILE_ENV,
    Seal,
    job_secret,
)
from pivot.bus.errors import AddressError, SecretError
from pivot.bus.nng import NngTransport
from pivot.bus.replay import ReplayWindow
from pivot.bus.testing import TESTING_MESSAGES, Echo, EchoActor

SECRET = "the job's secret"


class Tick(Message):
    n: int


MESSAGES = (*TESTING_MESSAGES, Tick)


class Tap(LocalTransport):
    """A local network with an eavesdropper: it records every request, reply and
    publication, and can answer the next request with a reply of its choosing."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, bytes]] = []
        self.replies: list[bytes] = []
        self.publications: list[tuple[str, bytes]] = []
        self.forged_reply: bytes | None = None

    async def request(self, to: str, frame: bytes, timeout: float) -> bytes:
        self.requests.append((to, frame))
        if self.forged_reply is not None:
            return self.forged_reply
        reply = await super().request(to, frame, timeout)
        self.replies.append(reply)
        return reply

    async def deliver(self, to: str, frame: bytes) -> bytes:
        """Hand ``frame`` to ``to`` as the attacker would, unrecorded."""
        return await LocalTransport.request(self, to, frame, 1.0)

    def _broadcast(self, publisher: str, frame: bytes) -> None:
        self.publications.append((publisher, frame))
        super()._broadcast(publisher, frame)


def secured_bus(clock: VirtualClock) -> tuple[Bus, Tap]:
    tap = Tap()
    return Bus(tap, Codec(MESSAGES, secret=SECRET), clock), tap


# -- bind policy


@pytest.mark.parametrize("address", ["ipc:///tmp/x.rep", "inproc://x"])
def test_ipc_and_inproc_need_no_secret(address: str) -> None:
    check_bind_address(address, secured=False)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:5555",  # loopback too: every local user can connect to it
        "tcp://localhost:1",
        "tcp://[::1]:1",
        "tcp4://127.0.0.1:1",
        "tcp://0.0.0.0:5555",
        "tcp://10.1.2.3:5555",
        "tcp://*:5555",
        "tcp://example.com:1",
    ],
)
def test_every_tcp_bind_is_refused_without_a_secret(address: str) -> None:
    with pytest.raises(InsecureBindError) as caught:
        check_bind_address(address, secured=False)
    assert caught.value.address == address
    assert address in str(caught.value)
    assert SECRET_ENV in str(caught.value) and SECRET_FILE_ENV in str(caught.value)
    check_bind_address(address, secured=True)


def test_malformed_addresses_are_named() -> None:
    with pytest.raises(AddressError, match="bad bus address 'http://x'"):
        check_bind_address("http://x", secured=True)
    with pytest.raises(AddressError, match="ipc path"):
        Directory.ipc("/tmp/" + "d" * 120, ["a"])


async def test_actor_refuses_insecure_bind_and_binds_nothing() -> None:
    directory = Directory.tcp("127.0.0.1", {"open": (0, 0)})
    actor = Actor("open", Bus.nng(directory, TESTING_MESSAGES))
    with pytest.raises(InsecureBindError, match=r"tcp://127\.0\.0\.1:0"):
        await actor.start()
    assert not actor.running
    assert directory.lookup("open").rep == "tcp://127.0.0.1:0"  # no port was taken
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
    intruder_bus = Bus.nng(directory, TESTING_MESSAGES, secret="a guess")
    server, client = EchoActor("server", bus), Actor("client", bus)
    intruder = Actor("intruder", intruder_bus)
    async with started(server, client, intruder):
        port = int(directory.lookup("server").rep.rsplit(":", 1)[1])
        assert port > 0  # the directory learned the bound port
        assert (await client.request("server", Echo(text="over tcp"), timeout=5)).text == "over tcp"
        with pytest.raises(RequestTimeout):
            await intruder.request("server", Echo(text="guessed"), timeout=0.3)
        assert server.stats.bad_hmac == 1
        assert server.seen == ["over tcp"]
    await bus.close()
    await intruder_bus.close()


async def test_an_actor_on_ipc_also_takes_requests_over_tcp_only_with_the_secret(
    tmp_path: Path,
) -> None:
    also = "tcp://127.0.0.1:0"
    ipc = Directory.ipc(tmp_path, ["server"])
    open_ = Directory({"server": Endpoint(**{**ipc.to_dict()["server"], "also_rep": (also,)})})
    insecure = Bus.nng(open_, TESTING_MESSAGES)
    with pytest.raises(InsecureBindError):
        await EchoActor("server", insecure).start()
    await insecure.close()
    directory = Directory({"server": Endpoint(**{**ipc.to_dict()["server"], "also_rep": (also,)})})
    bus = Bus.nng(directory, TESTING_MESSAGES, secret="s3cret")
    server = EchoActor("server", bus)
    async with started(server):
        [bound] = directory.lookup("server").also_rep
        assert bound.startswith("tcp://127.0.0.1:") and not bound.endswith(":0")
        # a process elsewhere knows only the tcp address
        remote = Directory({"server": Endpoint(rep=bound, pub=bound)})
        remote_bus = Bus.nng(remote, TESTING_MESSAGES, secret="s3cret")
        reply = await Actor("elsewhere", remote_bus).request("server", Echo(text="hi"), timeout=5)
        assert reply.text == "hi"
        # and the ipc address still serves this host
        local_bus = Bus.nng(ipc, TESTING_MESSAGES, secret="s3cret")
        reply = await Actor("here", local_bus).request("server", Echo(text="ho"), timeout=5)
        assert reply.text == "ho"
        await remote_bus.close()
        await local_bus.close()
    await bus.close()


# -- replayed and redirected frames


def test_a_replayed_request_is_dropped_and_counted() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        server, client = EchoActor("server", bus), Actor("client", bus)
        async with started(server, client):
            await client.request("server", Echo(text="pay once"), timeout=1)
            ((_, frame),) = tap.requests
            for _ in range(3):
                with pytest.raises(RequestTimeout):  # dropped without a reply
                    await tap.deliver("server", frame)
            assert server.seen == ["pay once"]
            assert server.stats.replayed == 3
            assert server.stats.requests_served == 1
            # the sender's next request is still welcome
            await client.request("server", Echo(text="next"), timeout=1)
            assert server.seen == ["pay once", "next"]

    run_virtual(main)


def test_a_request_redirected_to_another_actor_is_dropped_and_counted() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        meant, other = EchoActor("meant", bus), EchoActor("other", bus)
        async with started(meant, other, Actor("client", bus)) as (_, _, client):
            await client.request("meant", Echo(text="for meant"), timeout=1)
            ((_, frame),) = tap.requests
            with pytest.raises(RequestTimeout):
                await tap.deliver("other", frame)
            assert other.seen == []
            assert other.stats.misdirected == 1
            assert other.stats.replayed == other.stats.bad_hmac == 0

    run_virtual(main)


def reseal(frame: bytes, to: str, key: bytes) -> bytes:
    """``frame`` with its destination rewritten to ``to`` and a fresh HMAC under ``key``."""
    trailer = struct.Struct(">HQQ")
    size, incarnation, counter = trailer.unpack(frame[-MAC_SIZE - trailer.size : -MAC_SIZE])
    payload = frame[: -MAC_SIZE - trailer.size - size]
    signed = payload + to.encode() + trailer.pack(len(to.encode()), incarnation, counter)
    return signed + hmac.digest(key, signed, "sha256")


def test_a_frame_rewritten_or_resigned_without_the_secret_is_a_bad_hmac() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        meant, other = EchoActor("meant", bus), EchoActor("other", bus)
        async with started(meant, other, Actor("client", bus)) as (_, _, client):
            await client.request("meant", Echo(text="for meant"), timeout=1)
            ((_, frame),) = tap.requests
            mac = frame[-MAC_SIZE:]
            forgeries = [
                reseal(frame, "other", b"a guess")[:-MAC_SIZE] + mac,  # the old HMAC kept
                reseal(frame, "other", b"a guess"),  # signed with another key
                frame[:-MAC_SIZE] + hmac.digest(SECRET.encode(), frame[:5], "sha256"),
            ]
            for forged in forgeries:
                with pytest.raises(RequestTimeout):
                    await tap.deliver("other", forged)
            assert other.stats.bad_hmac == len(forgeries)
            assert other.seen == [] and other.stats.misdirected == 0
            # the check is the HMAC, not the bytes: resealed with the secret it is accepted
            honest = reseal(frame, "other", SECRET.encode())
            reply = bus.codec.reply_of(bus.codec.unseal(await tap.deliver("other", honest))[0])
            assert reply.body.text == "for meant"
            assert other.seen == ["for meant"]

    run_virtual(main)


def test_a_replayed_reply_is_refused_and_counted() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        server, client = EchoActor("server", bus), Actor("client", bus)
        other = Actor("other", bus)
        async with started(server, client, other):
            await client.request("server", Echo(text="yes"), timeout=1)
            (old_reply,) = tap.replies
            tap.forged_reply = old_reply
            with pytest.raises(ProtocolError, match="replayed"):
                await client.request("server", Echo(text="may I?"), timeout=1)
            assert client.stats.replayed == 1
            # handed to another requester it is misdirected: it answers someone else
            with pytest.raises(ProtocolError, match="misdirected"):
                await other.request("server", Echo(text="may I?"), timeout=1)
            assert other.stats.misdirected == 1
            tap.forged_reply = None
            assert (await client.request("server", Echo(text="ok"), timeout=1)).text == "ok"

    run_virtual(main)


def test_a_reply_to_another_destination_is_refused() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        one, two = EchoActor("one", bus), EchoActor("two", bus)
        async with started(one, two, Actor("client", bus)) as (_, _, client):
            await client.request("one", Echo(text="first to one"), timeout=1)
            # the first request to "two" has the same counter as the one to "one"
            tap.forged_reply = tap.replies[0]
            with pytest.raises(ProtocolError, match="replayed"):
                await client.request("two", Echo(text="first to two"), timeout=1)
            assert client.stats.replayed == 1

    run_virtual(main)


def test_a_replayed_publication_is_dropped_and_counted() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        publisher, subscriber = Actor("publisher", bus), Actor("subscriber", bus)
        async with started(publisher, subscriber):
            ticks = subscriber.subscribe("ticks", publishers="publisher")
            await publisher.publish("ticks", Tick(n=1))
            await publisher.publish("ticks", Tick(n=2))
            recorded = list(tap.publications)
            for name, frame in recorded:  # older than the newest, and the newest itself
                LocalTransport._broadcast(tap, name, frame)
            await publisher.publish("ticks", Tick(n=3))
            assert [p.message.n for p in ticks.drain()] == [1, 2, 3]
            assert subscriber.stats.replayed == 2
            assert subscriber.stats.dropped_frames == 2

    run_virtual(main)


def test_a_restarted_sender_is_a_new_incarnation_and_its_old_frames_stay_refused() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        server = EchoActor("server", bus)
        async with started(server):
            async with started(Actor("client", bus)) as (first,):
                await first.request("server", Echo(text="before"), timeout=1)
            async with started(Actor("client", bus)) as (second,):  # counters start afresh
                await second.request("server", Echo(text="after"), timeout=1)
                with pytest.raises(RequestTimeout):
                    await tap.deliver("server", tap.requests[0][1])
            async with started(Actor("publisher", bus)) as (publisher,):
                ticks = server.subscribe("ticks", publishers="publisher")
                await publisher.publish("ticks", Tick(n=1))
            async with started(Actor("publisher", bus)) as (publisher,):
                await publisher.publish("ticks", Tick(n=2))  # sequence 1 again, accepted
            assert server.seen == ["before", "after"]
            assert server.stats.replayed == 1
            assert [p.message.n for p in ticks.drain()] == [1, 2]

    run_virtual(main)


def test_requests_arriving_out_of_order_are_each_accepted_once() -> None:
    async def main(clock: VirtualClock) -> None:
        bus, tap = secured_bus(clock)
        server = EchoActor("server", bus)
        codec = bus.codec
        async with started(server):
            counters = list(range(1, 41))
            random.Random(7).shuffle(counters)
            frames = {
                c: codec.encode_request("sender", c, Echo(text=str(c)), Seal("server", 99, c))
                for c in counters
            }
            await asyncio.gather(*(tap.deliver("server", frames[c]) for c in counters))
            assert sorted(server.seen, key=int) == [str(c) for c in range(1, 41)]
            for c in (1, 17, 40):
                with pytest.raises(RequestTimeout):
                    await tap.deliver("server", frames[c])
            assert server.stats.replayed == 3
            # far ahead is fine; what then fell below the window is refused, once new or not
            ahead = 40 + REQUEST_WINDOW + 5
            late = codec.encode_request("sender", 0, Echo(text="late"), Seal("server", 99, 41))
            await tap.deliver(
                "server",
                codec.encode_request("sender", 0, Echo(text="ahead"), Seal("server", 99, ahead)),
            )
            with pytest.raises(RequestTimeout):
                await tap.deliver("server", late)
            assert server.stats.replayed == 4
            assert server.seen[-1] == "ahead"

    run_virtual(main)


def test_the_replay_window_forgets_the_least_recently_heard_first() -> None:
    window = ReplayWindow(size=8, keys=2)
    assert window.admit("a", 1) and window.admit("b", 1)
    assert not window.admit("a", 1)  # and "a" is now the most recently heard
    assert window.admit("c", 1)  # forgets "b"
    assert len(window) == 2
    assert window.admit("b", 1) and not window.admit("c", 1)
    with pytest.raises(ValueError, match="size >= 1"):
        ReplayWindow(size=0, keys=1)


async def test_concurrent_requests_and_a_replay_over_nng() -> None:
    class Recording(NngTransport):
        def __init__(self, directory: Directory) -> None:
            super().__init__(directory)
            self.sent: list[bytes] = []

        async def request(self, to: str, frame: bytes, timeout: float) -> bytes:
            self.sent.append(frame)
            return await super().request(to, frame, timeout)

    directory = Directory.inproc(["server", "client"], namespace=uuid.uuid4().hex)
    server_bus = Bus.nng(directory, MESSAGES, secret=SECRET)
    transport = Recording(directory)
    client_bus = Bus(transport, Codec(MESSAGES, secret=SECRET))
    server, client = EchoActor("server", server_bus), Actor("client", client_bus)
    async with started(server, client):
        texts = [f"m{i}" for i in range(48)]  # three times the server's concurrency
        replies = await asyncio.gather(
            *(client.request("server", Echo(text=t), timeout=5) for t in texts)
        )
        assert [r.text for r in replies] == texts
        with pytest.raises(RequestTimeout):
            await transport.request("server", transport.sent[5], 0.3)
        assert server.stats.replayed == 1
        assert sorted(server.seen) == sorted(texts)
    await server_bus.close()
    await client_bus.close()


async def test_a_slow_request_over_nng_is_sent_once(monkeypatch: pytest.MonkeyPatch) -> None:
    class Slow(EchoActor):
        @handles
        async def slow(self, msg: Tick) -> Tick:
            self.seen.append(str(msg.n))
            await asyncio.sleep(0.4)
            return msg

    real_req0 = pynng.Req0

    def impatient_req0(**options: object) -> pynng.Req0:
        # nng's default resend time is a minute, checked every second: make them 50 and
        # 10 ms, as the transport must override them
        sock = real_req0(**{"resend_time": 50, **options})
        pynng.options._setopt_ms(sock, "req:resend-tick", 10)
        return sock

    monkeypatch.setattr(pynng, "Req0", impatient_req0)
    directory = Directory.inproc(["server", "client"], namespace=uuid.uuid4().hex)
    bus = Bus.nng(directory, MESSAGES, secret=SECRET)
    server, client = Slow("server", bus), Actor("client", bus)
    async with started(server, client):
        assert await client.request("server", Tick(n=1), timeout=5) == Tick(n=1)
        assert server.seen == ["1"]
        assert server.stats.replayed == 0
    await bus.close()


# -- the secret from a file


def _secret_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / f"secret-{uuid.uuid4().hex}"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_the_secret_file_is_read_and_stripped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(_secret_file(tmp_path, "  from a file\n")))
    assert job_secret() == "from a file"
    monkeypatch.delenv(SECRET_FILE_ENV)
    assert job_secret() is None
    monkeypatch.setenv(SECRET_ENV, "from the environment")
    assert job_secret() == "from the environment"


@pytest.mark.parametrize(
    ("text", "mode", "complaint"),
    [
        (None, 0o600, "cannot read"),
        (" \n", 0o600, "is empty"),
        ("s3cret", 0o644, "open to other users"),
        ("s3cret", 0o640, "open to other users"),
    ],
)
def test_a_bad_secret_file_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | None, mode: int, complaint: str
) -> None:
    path = tmp_path / "missing" if text is None else _secret_file(tmp_path, text, mode)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with pytest.raises(SecretError, match=complaint) as caught:
        job_secret()
    assert f"{SECRET_FILE_ENV}={path}" in str(caught.value)


def test_the_secret_from_two_places_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "one")
    monkeypatch.setenv(SECRET_FILE_ENV, str(_secret_file(tmp_path, "two")))
    with pytest.raises(SecretError, match="not both"):
        job_secret()
