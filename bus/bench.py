"""Benchmark of the bus against raw pynng, side by side, in one run.

Request/reply: round-trip p50/p99 over ipc:// and tcp loopback, for raw pynng (Req0
and Rep0 contexts with ``asend``/``arecv``, msgspec encode/decode by hand) and for
the actor layer (``Actor.request`` to an actor's handler). Both servers live in one
second process, so placement is the same for both.

Pub/sub: a publisher in a second process sends as fast as it can; the subscriber here
counts what it receives. Raw = Sub0 ``arecv`` + decode per frame; ours = an actor's
subscription. Reported as messages received per second of receiving, with the share
of published messages that arrived (pub/sub drops what the subscriber cannot absorb).

Signing: a tcp bind needs the shared secret, so the tcp round trips are always signed;
``signed=True`` (``--signed``) signs the ipc round trips and pub/sub too. The secret is
made afresh for each run and reaches the second processes through their environment.

``run_bench(...) -> dict`` and ``format_table(result) -> str``; also
``python -m pivot.bus.bench [--json]``. The ``serve`` and ``publish`` subcommands
are the second processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pynng

from pivot.bus.actor import Actor, Bus, handles
from pivot.bus.clock import RealClock
from pivot.bus.codec import SECRET_ENV, SECRET_FILE_ENV, Message, job_secret
from pivot.bus.logs import configure_logging
from pivot.bus.nng import PUBSUB_BUFFER
from pivot.bus.transport import Directory


class BenchEcho(Message):
    """About the size of the 38-byte message of the platform notes."""

    seq: int
    payload: str


class BenchTick(Message):
    seq: int
    value: float


BENCH_MESSAGES = (BenchEcho, BenchTick)
_TOPIC = "bench"


class _EchoServer(Actor):
    @handles
    def echo(self, msg: BenchEcho) -> BenchEcho:
        return msg


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def _child(args: list[str], secret: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pivot.bus.bench", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        # the run's own secret, whatever the job's is
        env={**{k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}, SECRET_ENV: secret},
    )


def _ready(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("READY"):
        process.kill()
        raise RuntimeError(f"bench helper process failed to start (said {line!r})")
    return line[len("READY") :].strip()


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- request/reply


async def _raw_round_trips(address: str, count: int, warmup: int) -> list[float]:
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(BenchEcho).decode
    with pynng.Req0(dial=address) as sock:
        ctx = sock.new_context()
        times = []
        for seq in range(count + warmup):
            start = time.perf_counter()
            await ctx.asend(encode(BenchEcho(seq=seq, payload="x" * 16)))
            reply = decode(await ctx.arecv())
            times.append(time.perf_counter() - start)
            assert reply.seq == seq
        ctx.close()
    return times[warmup:]


async def _actor_round_trips(
    directory: Directory, count: int, warmup: int, fast_aio: bool, secret: str | None
) -> list[float]:
    bus = Bus.nng(directory, BENCH_MESSAGES, fast_aio=fast_aio, secret=secret)
    client = Actor("client", bus)
    await client.start()
    times = []
    try:
        for seq in range(count + warmup):
            start = time.perf_counter()
            reply = await client.request("server", BenchEcho(seq=seq, payload="x" * 16), timeout=10)
            times.append(time.perf_counter() - start)
            assert reply.seq == seq
    finally:
        await client.stop()
        await bus.close()
    return times[warmup:]


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "p50_us": round(_percentile(ordered, 0.50) * 1e6, 1),
        "p99_us": round(_percentile(ordered, 0.99) * 1e6, 1),
    }


async def _serve(folder: Path, fast_aio: bool, signed: bool) -> None:
    """The second process of the request/reply benchmark: raw and actor servers."""
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(BenchEcho).decode

    async def raw_loop(ctx: pynng.Context) -> None:
        try:
            while True:
                frame = await ctx.arecv()
                await ctx.asend(encode(decode(frame)))
        except pynng.Closed:
            with contextlib.suppress(pynng.NNGException):
                ctx.close()

    raw = {"ipc": f"ipc://{folder}/raw.rep", "tcp": "tcp://127.0.0.1:0"}
    sockets, tasks = [], []
    for kind, address in raw.items():
        sock = pynng.Rep0()
        listener = sock.listen(address)
        if kind == "tcp":
            raw[kind] = f"tcp://{listener.local_address}"
        sockets.append(sock)
        tasks += [asyncio.create_task(raw_loop(sock.new_context())) for _ in range(4)]
    directories = {
        "ipc": Directory.ipc(folder, ["server", "client"]),
        "tcp": Directory.tcp("127.0.0.1", {"server": (0, 0), "client": (0, 0)}),
    }
    secret = job_secret()
    secrets_of = {"ipc": secret if signed else None, "tcp": secret}
    servers = []
    for kind, directory in directories.items():
        bus = Bus.nng(directory, BENCH_MESSAGES, fast_aio=fast_aio, secret=secrets_of[kind])
        server = _EchoServer("server", bus)
        await server.start()
        servers.append(server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    info = {"raw": raw, "ours": {k: d.to_dict() for k, d in directories.items()}}
    print("READY", json.dumps(info), flush=True)
    await stop.wait()
    for server in servers:
        await server.stop()
    for sock in sockets:
        sock.close()
    await asyncio.gather(*tasks)


# -- pub/sub


async def _publish(kind: str, folder: Path, count: int, batch: int, signed: bool) -> None:
    """The second process of the pub/sub benchmark: publishes ``count`` messages as
    fast as it can once the parent writes a line on stdin."""
    loop = asyncio.get_running_loop()
    ticks = [BenchTick(seq=i, value=i * 0.5) for i in range(count)]
    if kind == "raw":
        encode = msgspec.msgpack.Encoder().encode
        sock = pynng.Pub0(send_buffer_size=PUBSUB_BUFFER, listen=f"ipc://{folder}/rawpub")
        print("READY", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        for tick in ticks:
            sock.send(encode(tick))
        await asyncio.sleep(1.0)  # let the buffers drain before closing
        sock.close()
        return
    directory = Directory.ipc(folder, ["publisher", "subscriber"])
    bus = Bus.nng(directory, BENCH_MESSAGES, secret=job_secret() if signed else None)
    publisher = Actor("publisher", bus)
    await publisher.start()
    print("READY", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    for start in range(0, count, batch):
        await publisher.publish(_TOPIC, *ticks[start : start + batch])
    await asyncio.sleep(1.0)
    await publisher.stop()
    await bus.close()


async def _receive_raw(folder: Path, count: int, go: Any) -> dict[str, float]:
    decode = msgspec.msgpack.Decoder(BenchTick).decode
    sock = pynng.Sub0(recv_buffer_size=PUBSUB_BUFFER)
    sock.subscribe(b"")
    sock.dial(f"ipc://{folder}/rawpub", block=True)
    await asyncio.sleep(0.3)  # the slow joiner: raw pynng has no handshake
    go()
    received, first, last = 0, 0.0, 0.0
    try:
        while received < count:
            try:
                decode(await asyncio.wait_for(sock.arecv(), 0.5))
            except TimeoutError:
                break
            last = time.perf_counter()
            if received == 0:
                first = last
            received += 1
    finally:
        sock.close()
    return _rate(received, first, last, count)


async def _receive_ours(folder: Path, count: int, go: Any, secret: str | None) -> dict[str, float]:
    bus = Bus.nng(Directory.ipc(folder, ["publisher", "subscriber"]), BENCH_MESSAGES, secret=secret)
    subscriber = Actor("subscriber", bus)
    await subscriber.start()
    # a queue as long as the run: we measure the bus, not a consumer that lags
    subscription = subscriber.subscribe(_TOPIC, publishers="publisher", maxlen=count)
    await subscription.wait_live("publisher", timeout=10)
    go()
    received, first, last = 0, 0.0, 0.0
    try:
        while received < count:
            try:
                await subscription.get(timeout=0.5)
            except TimeoutError:
                break
            last = time.perf_counter()
            if received == 0:
                first = last
            received += 1
    finally:
        await subscriber.stop()
        await bus.close()
    return _rate(received, first, last, count)


def _rate(received: int, first: float, last: float, count: int) -> dict[str, float]:
    span = last - first
    return {
        "msgs_per_s": round((received - 1) / span) if received > 1 and span > 0 else 0.0,
        "received": received,
        "delivered": round(received / count, 4),
    }


async def _pubsub_case(
    kind: str, count: int, batch: int, secret: str, signed: bool
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="pivot-bench-", dir="/tmp") as tmp:
        folder = Path(tmp)
        process = _child(
            [
                "publish",
                "--kind",
                kind,
                "--folder",
                tmp,
                "--count",
                str(count),
                "--batch",
                str(batch),
                *(["--signed"] if signed else []),
            ],
            secret,
        )
        try:
            _ready(process)
            assert process.stdin is not None
            stdin = process.stdin

            def go() -> None:
                stdin.write("go\n")
                stdin.flush()

            if kind == "raw":
                return await _receive_raw(folder, count, go)
            return await _receive_ours(folder, count, go, secret if signed else None)
        finally:
            _stop(process)


# -- the whole run


async def _run(
    requests: int,
    warmup: int,
    publications: int,
    batch: int,
    rounds: int,
    fast_aio: bool,
    signed: bool,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "requests": requests,
        "publications": publications,
        "batch": batch,
        "cpus": os.cpu_count(),
        "fast_aio": fast_aio,
        "signed": signed,
    }
    secret = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="pivot-bench-", dir="/tmp") as tmp:
        flags = [*([] if fast_aio else ["--public-aio"]), *(["--signed"] if signed else [])]
        server = _child(["serve", "--folder", tmp, *flags], secret)
        try:
            info = json.loads(_ready(server))
            rtt: dict[str, dict[str, list[float]]] = {
                "ipc": {"raw": [], "ours": []},
                "tcp": {"raw": [], "ours": []},
            }
            # alternate raw and ours in several rounds so that drifting machine load
            # falls on both alike
            per_round = max(1, requests // rounds)
            for _ in range(rounds):
                for transport in ("ipc", "tcp"):
                    rtt[transport]["raw"] += await _raw_round_trips(
                        info["raw"][transport], per_round, warmup
                    )
                    directory = Directory.from_dict(info["ours"][transport])
                    signer = secret if signed or transport == "tcp" else None
                    rtt[transport]["ours"] += await _actor_round_trips(
                        directory, per_round, warmup, fast_aio, signer
                    )
        finally:
            _stop(server)
    result["rtt"] = {t: {k: _summary(v) for k, v in kinds.items()} for t, kinds in rtt.items()}
    for transport in ("ipc", "tcp"):
        raw, ours = result["rtt"][transport]["raw"], result["rtt"][transport]["ours"]
        result[f"rtt_ratio_{transport}"] = round(ours["p50_us"] / raw["p50_us"], 3)
        result[f"rtt_p99_ratio_{transport}"] = round(ours["p99_us"] / raw["p99_us"], 3)
    result["pubsub"] = {
        "raw": await _pubsub_case("raw", publications, 1, secret, signed),
        "ours": await _pubsub_case("ours", publications, 1, secret, signed),
        "ours_batched": await _pubsub_case("ours", publications, batch, secret, signed),
    }
    raw_rate = result["pubsub"]["raw"]["msgs_per_s"]
    result["pubsub_ratio"] = (
        round(result["pubsub"]["ours"]["msgs_per_s"] / raw_rate, 3) if raw_rate else None
    )
    return result


def run_bench(
    *,
    requests: int = 3000,
    warmup: int = 100,
    publications: int = 30000,
    batch: int = 64,
    rounds: int = 3,
    use_uvloop: bool = True,
    fast_aio: bool = True,
    quick: bool = False,
    signed: bool = False,
) -> dict[str, Any]:
    """Run the benchmark (about 15-25 s on two cores) and return its figures.

    Keys: ``rtt`` ({ipc,tcp} x {raw,ours} x {p50_us,p99_us}), ``rtt_ratio_ipc``,
    ``rtt_ratio_tcp`` (ours/raw p50: lower is better), ``rtt_p99_ratio_*``,
    ``pubsub`` ({raw, ours, ours_batched} x {msgs_per_s, received, delivered}),
    ``pubsub_ratio`` (ours/raw msgs/s with one message per frame: higher is better).
    ``fast_aio=False`` runs the actor layer's request/reply on pynng's public
    ``asend``/``arecv`` instead of its lean nng_aio path, to isolate the layer's cost.
    ``quick=True`` is a smoke run (a few seconds; figures are rough). ``signed=True``
    signs every actor-layer frame (tcp is always signed: see the module docstring).
    """
    if quick:
        requests, warmup, publications, rounds = (
            min(requests, 300),
            min(warmup, 20),
            min(publications, 5000),
            1,
        )
    return RealClock(use_uvloop=use_uvloop).run(
        _run(requests, warmup, publications, batch, rounds, fast_aio, signed)
    )


def format_table(result: dict[str, Any]) -> str:
    """The benchmark result as a plain-text table."""
    lines = [
        f"pivot bus benchmark ({result['loop']}, {result['cpus']} CPUs, servers and publishers "
        f"in a second process; {result['requests']} round trips per case"
        f"{'' if result['fast_aio'] else '; actor layer on pynng public asend/arecv'}"
        f"; {'every frame' if result['signed'] else 'tcp only'} signed)",
        "",
        f"{'request/reply round trip':<26}{'raw pynng p50 / p99':>22}{'actor layer p50 / p99':>24}{'ours/raw p50 (p99)':>21}",
    ]
    for transport, label in (("ipc", "ipc://"), ("tcp", "tcp loopback")):
        raw, ours = result["rtt"][transport]["raw"], result["rtt"][transport]["ours"]
        lines.append(
            f"{label:<26}{raw['p50_us']:>10.0f} / {raw['p99_us']:>6.0f} us"
            f"{ours['p50_us']:>12.0f} / {ours['p99_us']:>6.0f} us"
            f"{result[f'rtt_ratio_{transport}']:>13.2f}x ({result[f'rtt_p99_ratio_{transport}']:.2f}x)"
        )
    pubsub = result["pubsub"]
    lines += [
        "",
        f"pub/sub over ipc://, {result['publications']} messages published unpaced",
        f"{'':<26}{'msgs/s received':>22}{'arrived':>12}",
    ]
    for key, label in (
        ("raw", "raw pynng, 1 per frame"),
        ("ours", "actor layer, 1 per frame"),
        ("ours_batched", f"actor layer, {result['batch']} per frame"),
    ):
        row = pubsub[key]
        lines.append(f"{label:<26}{row['msgs_per_s']:>22,.0f}{row['delivered'] * 100:>11.1f}%")
    ratio = result["pubsub_ratio"]
    lines.append(f"{'ours/raw msgs/s, 1 per frame':<26}{(f'{ratio:.2f}x' if ratio else 'n/a'):>22}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pivot.bus.bench")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve")
    serve.add_argument("--folder", required=True)
    serve.add_argument("--public-aio", action="store_true")
    serve.add_argument("--signed", action="store_true")
    publish = sub.add_parser("publish")
    publish.add_argument("--kind", choices=["raw", "ours"], required=True)
    publish.add_argument("--folder", required=True)
    publish.add_argument("--count", type=int, required=True)
    publish.add_argument("--batch", type=int, default=1)
    publish.add_argument("--signed", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--signed", action="store_true")
    args = parser.parse_args(argv)
    if args.command in ("serve", "publish"):
        from pivot.bus.child import set_parent_death_signal

        set_parent_death_signal()
        configure_logging("warning")
        clock = RealClock()
        if args.command == "serve":
            clock.run(_serve(Path(args.folder), not args.public_aio, args.signed))
        else:
            clock.run(_publish(args.kind, Path(args.folder), args.count, args.batch, args.signed))
        return 0
    result = run_bench(signed=args.signed)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
