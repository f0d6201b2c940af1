"""pivot.bus: the actor runtime. It knows nothing of RL.

Actors (``actor``)
    Actor(name, bus)                  base class; async start() / stop() / wait();
                                      hooks on_start(), on_stop(), run(); spawn(coro)
    @handles / @handles(MsgA, ..., calls_peers=False)   marks a handler ``(self, msg[, sender])
                                      -> reply``; calls_peers: it waits on other actors
    await actor.request(to, msg, *, timeout=None, expect=None) -> reply
    await actor.publish(topic, *msgs)            lossy, batched into one frame
    actor.subscribe(topic, *, publishers=None, maxlen=8192) -> Subscription
        async for pub in sub: pub.topic, pub.sender, pub.message
        await sub.get(timeout) / sub.get_nowait() / sub.drain()
        await sub.wait_live(publisher, timeout=5.0)  beat the slow joiner
    actor.stats: BusStats              counters (dropped frames, bad HMAC, replayed, ...)
    Bus(transport, codec, clock)       what the actors of a process share;
    Bus.local(messages, *, secret, clock, transport) / Bus.nng(directory, messages, ...)
    started(*actors)                   async context manager: start, then stop in reverse

Messages (``codec``)
    Message                           tagged msgspec.Struct base for application messages
    Codec(messages, *, secret=None)   with a secret every frame is sealed: HMAC over the
                                      envelope, destination and a per-sender counter
    job_secret()                      the job's secret from the environment, or None
    Ping, Pong, RemoteFailure          system messages the bus adds

Transports (``transport``, ``local``, ``nng``)
    Transport protocol; LocalTransport(); NngTransport(directory, *, fast_aio=True,
                                      max_frame, reply_timeout, in_process=True)
    Actor.connect(to)                 dial a peer ahead of its first request
    Directory({name: Endpoint(rep, pub)}) / .ipc(folder, names) / .inproc(names) / .tcp(...)
    check_bind_address(address, *, secured)   any tcp bind needs a secret

Time (``clock``)
    Clock protocol: now(), await sleep(dt), call_later(dt, fn, *args), rng
    RealClock(seed=None), VirtualClock(seed=0), run_virtual(main, seed=0), run_real(main)

Supervision (``supervisor``, ``child``, ``zygote``)
    Supervisor(clock=None, policy=None, launcher=None); add_actor(name, factory);
    add_process(name, "module:function", kwargs=..., env=...); await start() / wait() /
    stop() / run()
    RestartPolicy(restart, max_restarts, window, backoff, backoff_factor, backoff_max)
    Launcher: how process children start: ExecLauncher() (a fresh interpreter each, the
    default), ZygoteLauncher(preload).begin() (forked from a server that imported preload)

Errors (``errors``)
    BusError > RequestTimeout, RemoteError, Unreachable, ProtocolError,
    InsecureBindError, AddressError, SecretError, SupervisorEscalation

Counters in a file (``statsfile``)
    BusStatsFile(bus, path, *, process, interval=10.0)   async context manager: the bus's
                                      counters rewritten every interval and at exit
    Supervisor(stats_dir=DIR)          each child process writes DIR/<name>.json

Logging (``logs``)
    configure_logging(level="info", *, json=True, stream=None)

Benchmark: ``pivot.bus.bench`` (run_bench, format_table). Test helpers: ``pivot.bus.testing``.

What to rely on, and what not:
- Requests are answered or fail with a typed error; a handler error never kills the
  actor. Up to ``Actor.concurrency`` (16) requests run at once per actor in its request
  slots; a handler that waits on other actors is ``@handles(..., calls_peers=True)`` and
  runs outside them (up to ``Actor.peer_concurrency``), so peers calling each other
  cannot exhaust each other's slots.
- Pub/sub is lossy (full buffers drop, late subscribers miss what came before
  ``wait_live``): metrics and events only, never anything that must arrive.
- ``VirtualClock`` works with the local transport only (the nng one refuses it).
- ``await bus.close()`` when done: it closes the request sockets actors share.
"""

from pivot.bus.actor import Actor, Bus, Publication, Subscription, handles, started
from pivot.bus.clock import (
    Clock,
    RealClock,
    VirtualClock,
    VirtualDeadlock,
    VirtualEventLoop,
    run_real,
    run_virtual,
)
from pivot.bus.codec import Codec, Message, Ping, Pong, RemoteFailure, job_secret
from pivot.bus.errors import (
    AddressError,
    BusError,
    InsecureBindError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    SecretError,
    Unreachable,
)
from pivot.bus.local import LocalTransport
from pivot.bus.logs import configure_logging
from pivot.bus.nng import NngTransport
from pivot.bus.stats import BusStats
from pivot.bus.supervisor import RestartPolicy, Supervisor, SupervisorEscalation, SupervisorEvent
from pivot.bus.transport import Directory, Endpoint, Transport, check_bind_address

__all__ = [
    "Actor",
    "AddressError",
    "Bus",
    "BusError",
    "BusStats",
    "Clock",
    "Codec",
    "Directory",
    "Endpoint",
    "InsecureBindError",
    "LocalTransport",
    "Message",
    "NngTransport",
    "Ping",
    "Pong",
    "ProtocolError",
    "Publication",
    "RealClock",
    "RemoteError",
    "RemoteFailure",
    "RequestTimeout",
    "RestartPolicy",
    "SecretError",
    "Subscription",
    "Supervisor",
    "SupervisorEscalation",
    "SupervisorEvent",
    "Transport",
    "Unreachable",
    "VirtualClock",
    "VirtualDeadlock",
    "VirtualEventLoop",
    "check_bind_address",
    "configure_logging",
    "handles",
    "job_secret",
    "run_real",
    "run_virtual",
    "started",
]
