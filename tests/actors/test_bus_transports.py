"""The same actor behaviour over every transport: local, nng inproc://, nng ipc://."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import struct
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import pynng
import pytest
import structlog

from pivot.bus import (
    Actor,
    Bus,
    Directory,
    LocalTransport,
    Message,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    Unreachable,
    configure_logging,
    handles,
    started,
)
from pivot.bus.codec import Codec, Seal
from pivot.bus.nng import NngTransport
from pivot.bus.testing import TESTING_MESSAGES, Crash, Echo, EchoActor, Echoed, Fail

NAMES = ["server", "client", "other", "ghost"]  # "ghost" is in the directory, never started


class Slow(Message):
    seconds: float


class Tick(Message):
    n: int


class StopYourself(Message):
    pass


class Forward(Message):
    """Ask the other actor to bounce ``text`` back to this one."""

    text: str


class Unknown(Message):
    """Only the client's codec knows this one."""


MESSAGES = (*TESTING_MESSAGES, Slow, Tick, StopYourself, Forward)


class Server(EchoActor):
    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.in_flight = 0
        self.most_in_flight = 0

    @handles
    async def slow(self, msg: Slow) -> Echoed:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(msg.seconds)
        finally:
            self.in_flight -= 1
        return Echoed(text="slept", by=self.name)

    @handles
    async def stop_yourself(self, msg: StopYourself) -> Echoed:
        await self.stop()
        return Echoed(text="never delivered", by=self.name)


class Client(Actor):
    pass


class Peer(EchoActor):
    """One request slot; ``Forward`` waits on the peer, whose ``Forward`` calls back here."""

    concurrency = 1

    def __init__(self, name: str, bus: Bus, peer: str) -> None:
        super().__init__(name, bus)
        self.peer = peer

    @handles(calls_peers=True)
    async def forward(self, msg: Forward, sender: str) -> Echoed:
        if sender == self.peer:  # the bounce: back to the peer's own Echo handler
            return await self.request(self.peer, Echo(text=msg.text), timeout=5, expect=Echoed)
        return await self.request(self.peer, msg, timeout=5, expect=Echoed)


MakeBus = Callable[..., Bus]


@pytest.fixture(params=["local", "nng-inproc", "nng-ipc", "nng-ipc-public-aio", "nng-in-process"])
async def make_bus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[MakeBus]:
    """Makes buses that can reach each other, as separate processes' buses would; on one
    bus, actors reach each other over their sockets, but with ``nng-in-process`` (the nng
    transport's default), where they take the in-process way."""
    kind = request.param
    buses: list[Bus] = []
    local = LocalTransport()
    if kind == "nng-inproc":
        directory = Directory.inproc(NAMES, namespace=uuid.uuid4().hex)
    else:
        directory = Directory.ipc(tmp_path_factory.mktemp("ipc"), NAMES)

    def make(
        messages: tuple[type[msgspec.Struct], ...] = MESSAGES, secret: str | None = None
    ) -> Bus:
        if kind == "local":
            bus = Bus(local, Codec(messages, secret=secret))
        else:
            transport = NngTransport(
                directory,
                fast_aio=kind != "nng-ipc-public-aio",
                in_process=kind == "nng-in-process",
            )
            bus = Bus(transport, Codec(messages, secret=secret))
        buses.append(bus)
        return bus

    yield make
    for bus in buses:
        await bus.close()


async def test_request_returns_the_typed_reply(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        reply = await client.request("server", Echo(text="hello"), timeout=5, expect=Echoed)
        assert reply == Echoed(text="hello", by="server")
        assert server.seen == ["hello"]
        assert client.stats.requests_sent == client.stats.replies_received == 1
        assert server.stats.requests_served == 1


async def test_one_actor_serves_many_requests_at_once(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        replies = await asyncio.gather(
            *(client.request("server", Slow(seconds=0.05), timeout=5) for _ in range(8))
        )
        assert [r.text for r in replies] == ["slept"] * 8
        assert server.most_in_flight > 1  # they overlapped in the handler


async def test_actors_that_call_each_other_do_not_exhaust_each_others_slots(
    make_bus: MakeBus,
) -> None:
    # each handler below waits on the other actor, which calls back; with one slot each,
    # holding the slot while waiting would leave the call back none (a timeout)
    bus = make_bus()
    one, two = Peer("server", bus, peer="other"), Peer("other", bus, peer="server")
    client = Client("client", bus)
    async with started(one, two, client):
        replies = await asyncio.gather(
            *(client.request("server", Forward(text=str(i)), timeout=5) for i in range(4))
        )
        assert [r.text for r in replies] == ["0", "1", "2", "3"]
        assert sorted(one.seen) == ["0", "1", "2", "3"]  # served by the first actor's Echo
        assert one.stats.requests_served == 8 and two.stats.requests_served == 4


async def test_request_times_out_and_the_actor_keeps_serving(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        with pytest.raises(RequestTimeout) as caught:
            await client.request("server", Slow(seconds=0.5), timeout=0.05)
        assert caught.value.to == "server"
        assert client.stats.request_timeouts == 1
        assert (await client.request("server", Echo(text="after"), timeout=5)).text == "after"


async def test_handler_error_becomes_remote_error(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        with pytest.raises(RemoteError) as caught:
            await client.request("server", Fail(text="boom"), timeout=5)
        error = caught.value
        assert (error.actor, error.code, error.error_type, error.text) == (
            "server", "handler_error", "RuntimeError", "boom",
        )  # fmt: skip
        assert server.stats.handler_errors == 1
        assert (
            await client.request("server", Echo(text="still here"), timeout=5)
        ).text == "still here"


async def test_unknown_message_type_gets_an_error_reply(make_bus: MakeBus) -> None:
    server_bus = make_bus()
    client_bus = make_bus((*MESSAGES, Unknown))
    server, client = Server("server", server_bus), Client("client", client_bus)
    async with started(server, client):
        with pytest.raises(RemoteError) as caught:
            await client.request("server", Unknown(), timeout=5)
        assert caught.value.code == "bad_message"
        assert "Unknown" in caught.value.text
        assert server.stats.decode_errors == 1
        assert (await client.request("server", Echo(text="next"), timeout=5)).text == "next"


async def test_garbage_frame_gets_an_error_reply(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        raw = await bus.transport.request("server", b"\xc1 not msgpack", 5.0)
        envelope = bus.codec.decode_reply(raw)
        assert type(envelope) is bus.codec.ErrorEnvelope
        assert envelope.body.code == "bad_message"
        assert server.stats.decode_errors == 1
        # a frame nested past the decoder's recursion limit gets its error reply too
        raw = await bus.transport.request("server", b"\x91" * 100_000 + b"\xc0", 5.0)
        assert bus.codec.decode_reply(raw).body.code == "bad_message"
        assert server.stats.decode_errors == 2
        assert (await client.request("server", Echo(text="ok"), timeout=5)).text == "ok"


async def test_message_without_handler_gets_an_error_reply(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Client("server", bus), Client("client", bus)  # Client handles nothing
    async with started(server, client):
        with pytest.raises(RemoteError) as caught:
            await client.request("server", Echo(text="x"), timeout=5)
        assert caught.value.code == "no_handler"
        await client.ping("server", timeout=5)  # the bus's own Ping still works


async def test_unreachable_actors(make_bus: MakeBus) -> None:
    bus = make_bus()
    client = Client("client", bus)
    async with started(client):
        with pytest.raises(Unreachable) as caught:
            await client.request("nobody", Echo(text="x"), timeout=1)
        assert caught.value.to == "nobody"
        with pytest.raises(Unreachable):
            await client.request("ghost", Echo(text="x"), timeout=1)  # known, not listening
        assert client.stats.unreachable == 2


async def test_connect_dials_ahead_of_the_first_request(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        transport = bus.transport
        await client.connect("server", timeout=5)
        in_process = isinstance(transport, NngTransport) and transport._serves("server")
        if isinstance(transport, NngTransport):  # dialled before anything was sent
            assert ("server" in transport._peers) is not in_process
        reply = await client.request("server", Echo(text="hello"), timeout=5, expect=Echoed)
        assert reply.by == "server"
        if in_process:  # no socket at all
            assert transport._peers == {}
        for nobody in ("nobody", "ghost"):  # unknown; known, not listening
            with pytest.raises(Unreachable):
                await client.connect(nobody, timeout=1)


async def test_stopped_actor_becomes_unreachable(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(client):
        await server.start()
        await client.ping("server", timeout=5)
        await server.stop()
        with pytest.raises((Unreachable, RequestTimeout)):
            await client.request("server", Echo(text="x"), timeout=0.5)


async def test_restarted_actor_is_reachable_again(make_bus: MakeBus) -> None:
    bus = make_bus()
    client = Client("client", bus)
    async with started(client):
        first = Server("server", bus)
        await first.start()
        await client.request("server", Echo(text="one"), timeout=5)
        await first.stop()
        second = Server("server", bus)
        await second.start()
        for _ in range(50):  # nng redials in the background: retry while it reconnects
            try:
                reply = await client.request("server", Echo(text="two"), timeout=0.5)
                break
            except (Unreachable, RequestTimeout):
                await asyncio.sleep(0.02)
        assert reply.text == "two"
        assert second.seen == ["two"] and first.seen == ["one"]
        await second.stop()


async def test_handler_may_stop_its_own_actor(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(client):
        await server.start()
        with pytest.raises((RequestTimeout, Unreachable)):  # the reply dies with the socket
            await client.request("server", StopYourself(), timeout=0.3)
        await asyncio.wait_for(server.wait(), 5)  # stopped cleanly, no crash
        assert not server.running and server.failure is None


async def test_unexpected_reply_type_is_a_protocol_error(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        with pytest.raises(ProtocolError):
            await client.request("server", Echo(text="x"), timeout=5, expect=Tick)


async def test_pubsub_delivers_batches_in_order(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        ticks = client.subscribe("ticks", publishers="server")
        other_topic = client.subscribe("tocks", publishers="server")
        await ticks.wait_live("server", timeout=5)
        for start in range(0, 100, 10):
            await server.publish("ticks", *(Tick(n=i) for i in range(start, start + 10)))
        got = [(await ticks.get(timeout=5)).message.n for _ in range(100)]
        assert got == list(range(100))
        assert len(other_topic) == 0
        assert server.stats.published == 100 and server.stats.publish_frames == 10
        assert client.stats.received == 100 and client.stats.lost_frames == 0


async def test_subscription_filters_by_publisher(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, other, client = Server("server", bus), Server("other", bus), Client("client", bus)
    async with started(server, other, client):
        from_server = client.subscribe("ticks", publishers=["server"])
        from_anyone = client.subscribe("ticks")
        await from_server.wait_live("server", timeout=5)
        await from_anyone.wait_live("other", timeout=5)
        await other.publish("ticks", Tick(n=1))
        await server.publish("ticks", Tick(n=2))
        first, second = await from_anyone.get(timeout=5), await from_anyone.get(timeout=5)
        assert {(first.sender, first.message.n), (second.sender, second.message.n)} == {
            ("other", 1),
            ("server", 2),
        }
        only = await from_server.get(timeout=5)
        assert (only.sender, only.message.n) == ("server", 2)
        assert from_server.get_nowait() is None


async def test_bad_hmac_is_dropped_and_counted(make_bus: MakeBus) -> None:
    server_bus = make_bus(secret="right secret")
    client_bus = make_bus(secret="wrong secret")
    server = Server("server", server_bus)
    client = Client("client", client_bus)
    friend = Client("other", make_bus(secret="right secret"))
    async with started(server, client, friend):
        with pytest.raises(RequestTimeout):  # dropped, not answered
            await client.request("server", Echo(text="let me in"), timeout=0.15)
        assert server.stats.bad_hmac == 1
        assert server.seen == []
        # the right secret still gets through, and publications are checked too
        assert (await friend.request("server", Echo(text="hi"), timeout=5)).text == "hi"
        wrong_sub = client.subscribe("ticks", publishers="server")
        right_sub = friend.subscribe("ticks", publishers="server")
        await right_sub.wait_live("server", timeout=5)
        await server.publish("ticks", Tick(n=7))
        assert (await right_sub.get(timeout=5)).message == Tick(n=7)
        for _ in range(100):  # nng delivers asynchronously: wait for the frame to be judged
            if client.stats.bad_hmac:
                break
            await asyncio.sleep(0.01)
        assert client.stats.bad_hmac >= 1
        assert len(wrong_sub) == 0


async def test_crash_stops_the_actor_and_wait_raises(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(client):
        await server.start()
        await client.request("server", Crash(), timeout=5)
        with pytest.raises(RuntimeError, match="crash requested"):
            await asyncio.wait_for(server.wait(), 5)
        assert not server.running
        assert isinstance(server.failure, RuntimeError)


async def test_logs_carry_actor_message_type_and_cid(make_bus: MakeBus) -> None:
    stream = io.StringIO()
    configure_logging("info", json=True, stream=stream)
    try:
        bus = make_bus()
        server, client = Server("server", bus), Client("client", bus)
        async with started(server, client):
            with pytest.raises(RemoteError):
                await client.request("server", Fail(text="logged"), timeout=5)
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    failure = next(line for line in lines if line["event"] == "handler raised")
    assert failure["actor"] == "server"
    assert failure["msg_type"] == "Fail"
    assert failure["cid"] == 1
    assert failure["level"] == "error"
    assert "RuntimeError: logged" in failure["exception"]


async def test_full_subscription_drops_its_oldest(make_bus: MakeBus) -> None:
    bus = make_bus()
    server, client = Server("server", bus), Client("client", bus)
    async with started(server, client):
        ticks = client.subscribe("ticks", publishers="server", maxlen=3)
        await ticks.wait_live("server", timeout=5)
        for n in range(5):
            await server.publish("ticks", Tick(n=n))
        for _ in range(200):
            if client.stats.received == 5:
                break
            await asyncio.sleep(0.01)
        assert [p.message.n for p in ticks.drain()] == [2, 3, 4]
        assert client.stats.dropped_publications == 2


async def test_bad_publication_frames_are_dropped_counted_and_survived(make_bus: MakeBus) -> None:
    bus = make_bus()
    client = Client("client", bus)
    async with started(client):
        ticks = client.subscribe("ticks", publishers="other")
        codec, prefix = bus.codec, b"ticks\0"
        frames = [
            codec.encode_publish("other", prefix, 1, [Tick(n=1)]),
            prefix + b"\xc1 garbage",
            codec.encode_publish("other", prefix, 2, [Tick(n=2)]),
            codec.encode_publish("other", prefix, 5, [Tick(n=5)]),  # 3 and 4 were lost
        ]
        if isinstance(bus.transport, LocalTransport):
            for frame in frames:
                bus.transport._broadcast("other", frame)
        else:  # a foreign publisher, speaking raw nng at other's address
            with pynng.Pub0(listen=bus.transport.directory.lookup("other").pub) as raw:
                for _ in range(200):  # until our subscriber has connected
                    raw.send(prefix + b"\xc1 warm-up")
                    if client.stats.decode_errors:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)  # let warm-up frames still in flight land
                warm_up_errors = client.stats.decode_errors
                for frame in frames:
                    raw.send(frame)
                for _ in range(200):
                    if client.stats.received == 3:
                        break
                    await asyncio.sleep(0.01)
            client.stats.decode_errors -= warm_up_errors
            client.stats.dropped_frames -= warm_up_errors
        got = [(await ticks.get(timeout=5)).message.n for _ in range(3)]
        assert got == [1, 2, 5]
        assert client.stats.decode_errors == 1
        assert client.stats.dropped_frames == 1
        assert client.stats.lost_frames == 2


def test_a_module_logger_taken_at_import_follows_the_later_configuration():
    """bus/nng.py takes its logger at import, before `pivot run` configures logging: its lines
    must still be JSON on the configured stream (a fresh interpreter: import order matters)."""
    import subprocess
    import sys

    script = (
        "import io, json\n"
        "from pivot.bus import nng\n"
        "from pivot.bus.logs import configure_logging\n"
        "stream = io.StringIO()\n"
        "configure_logging('info', stream=stream)\n"
        "nng.log.warning('probe')\n"
        "print(stream.getvalue().strip())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert (record["transport"], record["event"], record["level"]) == ("nng", "probe", "warning")


async def test_a_frame_over_the_maximum_is_refused_and_the_actor_serves_on(tmp_path) -> None:
    """A request larger than the receiver's maximum never reaches it (nng refuses it before
    allocating); the actor keeps serving everyone else."""
    directory = Directory.ipc(tmp_path, NAMES)
    server_bus = Bus(NngTransport(directory, max_frame=64 << 10), Codec(MESSAGES))
    client_bus = Bus(NngTransport(directory), Codec(MESSAGES))
    server, client = Server("server", server_bus), Client("client", client_bus)
    try:
        async with started(server, client):
            with pytest.raises(RequestTimeout):
                await client.request("server", Echo(text="x" * (1 << 20)), timeout=1.0)
            assert server.seen == []
            reply = await client.request("server", Echo(text="small"), timeout=5, expect=Echoed)
            assert reply.text == "small" and server.seen == ["small"]
    finally:
        await server_bus.close()
        await client_bus.close()


def _raw_requester(address: str) -> socket.socket:
    """A Req0 peer written by hand, speaking nng's SP wire protocol on a plain socket, so that
    it can do what no nng socket does: send requests and never read the replies (an nng Req0
    reads every reply off the connection, wanted or not, and so never fills the buffers)."""
    if address.startswith("ipc://"):
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect(address.removeprefix("ipc://"))
    else:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        peer = socket.create_connection((host, int(port)))
    peer.sendall(b"\x00SP\x00" + struct.pack(">H", 0x30) + b"\x00\x00")  # SP header, Req0
    return peer


def _sp_request(address: str, request_id: int, body: bytes) -> bytes:
    # the request id, top bit set, is the whole backtrace; ipc prefixes a message-type byte
    payload = struct.pack(">I", request_id | 0x8000_0000) + body
    kind = b"\x01" if address.startswith("ipc://") else b""
    return kind + struct.pack(">Q", len(payload)) + payload


def _flood(peer: socket.socket, messages: list[bytes]) -> int:
    sent = 0
    with contextlib.suppress(OSError):  # the socket's timeout: the server stopped reading
        for message in messages:
            peer.sendall(message)
            sent += 1
    return sent


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_a_requester_that_never_reads_its_replies_does_not_wedge_the_actor(
    tmp_path, scheme: str
) -> None:
    """Replies of 1 MiB to a peer that never reads fill the socket buffers; each reply send
    past them is abandoned after the reply timeout (counted, logged at counts 1, 2, 4...), so
    the actor's contexts go on serving and a well-behaved client still gets its reply."""
    if scheme == "ipc":
        directory = Directory.ipc(tmp_path, NAMES)
    else:
        directory = Directory.tcp("127.0.0.1", {name: (0, 0) for name in NAMES})
    stream = io.StringIO()
    configure_logging("warning", stream=stream)
    secret = b"s" * 32  # tcp binds only with one
    server_bus = Bus(NngTransport(directory, reply_timeout=0.3), Codec(MESSAGES, secret=secret))
    client_bus = Bus(NngTransport(directory), Codec(MESSAGES, secret=secret))
    server, client = Server("server", server_bus), Client("client", client_bus)
    try:
        async with started(server, client):
            address = directory.lookup("server").rep
            big = Echo(text="x" * (1 << 20))
            # 48 requests: far more replies than the buffers hold plus one per context (16),
            # each sealed once for the server
            messages = [
                _sp_request(
                    address,
                    i + 1,
                    server_bus.codec.encode_request("peer", 1, big, Seal("server", 7, i + 1)),
                )
                for i in range(48)
            ]
            peer = _raw_requester(address)
            peer.settimeout(2.0)
            try:
                sent = await asyncio.to_thread(_flood, peer, messages)
                assert sent == len(messages)
                # the flood's bytes may still sit in the server's receive buffer: wait until
                # every request was served and the replies past the buffers were abandoned,
                # while the peer stays connected (closing it drops pending replies uncounted)
                for _ in range(400):
                    if len(server.seen) == len(messages) and server.stats.reply_timeouts >= 16:
                        break
                    await asyncio.sleep(0.05)
                reply = await client.request("server", Echo(text="hi"), timeout=5, expect=Echoed)
                assert reply.text == "hi"
            finally:
                peer.close()
    finally:
        await server_bus.close()
        await client_bus.close()
        structlog.reset_defaults()
    abandoned = server.stats.reply_timeouts
    assert 16 <= abandoned < len(messages)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    counts = [line["count"] for line in lines if line["event"].startswith("reply abandoned")]
    assert counts == [1 << k for k in range(abandoned.bit_length())]
