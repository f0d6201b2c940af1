"""A fork server for child processes: a process that imports the libraries a job's children
need once (torch, transformers, DeepSpeed: seconds of CPU each), then forks each child from
that state, so that a child starts in milliseconds where ``python -m pivot.bus.child`` would
import them again in every process, every restart included.

    launcher = ZygoteLauncher(["torch", "pkg.mod:warm_up"])   # a ``Launcher``
    launcher.begin()            # the server starts importing now (no event loop needed)
    process = await launcher.spawn(args, env)                 # as ``ExecLauncher.spawn``
    await launcher.close()

    python -m pivot.bus.zygote --fd N [--preload MODULE[:FUNCTION]]...   the server

A forked child is what ``python -m pivot.bus.child ARGS`` would be: its own session (process
group), ``env`` as its whole environment, the launcher's working directory, stdin from
/dev/null, stdout a pipe its launcher reads (``READY``/``FAILED``), stderr the launcher's.
Its parent is the server, so the server reports its pid when forked and its exit code when
reaped (negative: the signal that ended it, as ``asyncio.subprocess.Process.returncode``). The
death signal chains: the server asks for SIGTERM when the launcher's process dies, and each
child (``pivot.bus.child``) asks for SIGTERM when the server dies, so no child outlives the
launcher's process, even a SIGKILLed one.

What a forked child shares with the server: the modules the server imported, as they were
imported (a module that reads the environment at import read the launcher's at ``begin``, not
the child's ``env``; the entries of the child's ``PYTHONPATH`` are put first on its path); one thread, since fork copies only the caller's (the server is started
with one thread for OpenMP and OpenBLAS, which would otherwise start pools at import; a
child's libraries set their own thread counts, as pivot's engines and trainer do, from
``torch.set_num_threads``); and the state of unseeded generators other than Python's
``random`` (which reseeds at fork). A server whose preload leaves more than one thread
refuses to serve, and so does one that does not start within ``ready_timeout``: the
launcher then starts every child with ``ExecLauncher``, and says so once. So does it for the
children after the server dies (they die with it, through their death signal).

Why not ``multiprocessing``'s forkserver: it is one per interpreter, with one preload list for
the process's life (a test suite's supervisors each want their own); its children inherit the
server's stdio, where a supervised child's stdout is a pipe of its own (``READY``/``FAILED``)
and its process group is its own to be signalled; and it runs a pickled ``Process``, not
``pivot.bus.child``, so exec'd and forked children would start two different ways.

Protocol: one ``SOCK_SEQPACKET`` pair, one JSON message per packet. Launcher to server:
``{"args", "env", "cwd"}`` with three descriptors (stdin, stdout, stderr). Server to
launcher: ``{"ready": pid}`` or ``{"refused": reason}`` once, then ``{"spawned": pid}`` per
request in order (or ``{"unspawned": reason}``), and ``{"exited": pid, "code": code}`` as
children end (always after their ``spawned``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from pivot.bus import child
from pivot.bus.logs import get_logger
from pivot.bus.supervisor import ExecLauncher, ProcessHandle, signal_group

#: The largest message either side sends: a request carries the child's kwargs (JSON).
MAX_MESSAGE = 1 << 20
#: Single-threaded numerics at import (their pools would start threads before any fork).
SERVER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ForkedProcess:
    """A child the server forked, as the supervisor sees a process: ``pid``, ``stdout``,
    ``returncode`` and ``wait()``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stdout: asyncio.StreamReader | None = None  # the pipe's, once connected
        self.returncode: int | None = None
        self._ended = asyncio.get_running_loop().create_future()

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)


class _ClosingAtEof(asyncio.StreamReaderProtocol):
    """A child's stdout pipe, closed at its end: uvloop leaves a read pipe's transport open
    at EOF, and closes its descriptor only when collected, after the pipe's file object may
    have closed it first, so that the second close hits whatever reused the number (a
    tensorboard writer's file, in a job whose Controller was restarted)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._pipe = transport

    def eof_received(self) -> bool:
        super().eof_received()
        self._pipe.close()  # the transport closes the file object too: one close
        return False


class ZygoteLauncher:
    """Starts children by fork from a server that imported ``preload`` (module names, or
    ``module:function`` to call once imported): see the module docstring."""

    def __init__(self, preload: Sequence[str], *, ready_timeout: float = 120.0) -> None:
        self.preload = list(preload)
        self.ready_timeout = ready_timeout
        self.log = get_logger(actor="zygote")
        self._exec = ExecLauncher()
        self._server: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready: asyncio.Future[None] | None = None  # done: ready, or refused
        self._pending: collections.deque[tuple[asyncio.Future[ForkedProcess], int]] = (
            collections.deque()
        )
        self._children: dict[int, ForkedProcess] = {}
        self._refused: str | None = None  # why children start by exec instead

    @property
    def pid(self) -> int | None:
        """The server's pid (None before ``begin``)."""
        return self._server.pid if self._server is not None else None

    @property
    def refused(self) -> str | None:
        """Why children start by exec (None: they are forked)."""
        return self._refused

    def begin(self) -> None:
        """Start the server (once): it imports ``preload`` while the caller goes on."""
        if self._server is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        args = [f"--preload={p}" for p in self.preload]
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "pivot.bus.zygote", "--fd", str(theirs.fileno()), *args],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env={**os.environ, **SERVER_ENV},
                start_new_session=True,  # a Ctrl-C to the terminal's group is the launcher's
            )
        finally:
            theirs.close()
        self._sock = ours

    async def spawn(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        """A child running ``pivot.bus.child`` with ``args`` (``--parent-pid`` added)."""
        if not await self._serving():
            return await self._exec.spawn(args, env)
        assert self._sock is not None and self._server is not None
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        request = {
            "args": [*args, "--parent-pid", str(self._server.pid)],
            "env": dict(env),
            "cwd": os.getcwd(),
        }
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [stdin, write_end, 2])
        except OSError as exc:
            os.close(read_end)
            if exc.errno != errno.EMSGSIZE:  # (a request too big for a packet: this one only)
                self._lost(f"the fork server took no request ({exc})")
            return await self._exec.spawn(args, env)
        finally:
            os.close(stdin)
            os.close(write_end)
        forked: asyncio.Future[ForkedProcess] = loop.create_future()
        self._pending.append((forked, read_end))
        process = await forked
        process.stdout = asyncio.StreamReader()
        await loop.connect_read_pipe(
            lambda: _ClosingAtEof(process.stdout), os.fdopen(read_end, "rb", 0)
        )
        return process

    async def close(self) -> None:
        """Stop the server (its children are the caller's to stop first)."""
        if self._sock is not None:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._sock)
            self._sock.close()
            self._sock = None
        if self._server is not None and self._server.poll() is None:
            for _ in range(100):  # it exits at the closed socket's EOF
                if self._server.poll() is not None:
                    break
                await asyncio.sleep(0.02)
            else:
                self._server.kill()
                self._server.wait()

    async def _serving(self) -> bool:
        """Whether the server forks this request (it is started, and ready in time)."""
        if self._refused is not None:
            return False
        self.begin()
        if self._ready is None:
            assert self._sock is not None
            self._ready = asyncio.get_running_loop().create_future()
            self._sock.setblocking(False)
            asyncio.get_running_loop().add_reader(self._sock, self._on_message)
        try:
            async with asyncio.timeout(self.ready_timeout):
                await asyncio.shield(self._ready)
        except TimeoutError:
            self._lost(f"the fork server was not ready within {self.ready_timeout:g} s")
        return self._refused is None

    def _on_message(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, 0)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(f"the fork server's socket failed ({exc})")
                return
            for fd in fds:  # the server sends none; never leak one
                os.close(fd)
            if not data:
                self._lost("the fork server exited")
                return
            self._handle(json.loads(data))

    def _handle(self, message: dict[str, Any]) -> None:
        assert self._ready is not None
        if "ready" in message:
            self._ready.set_result(None)
        elif "refused" in message:
            self._lost(f"the fork server refused to serve: {message['refused']}")
        elif "spawned" in message or "unspawned" in message:
            forked, read_end = self._pending.popleft()
            if "unspawned" in message:
                os.close(read_end)
                forked.set_exception(OSError(f"fork server: {message['unspawned']}"))
                return
            # registered now: its exit may be the very next message
            process = self._children[message["spawned"]] = ForkedProcess(message["spawned"])
            forked.set_result(process)
        elif "exited" in message:
            process = self._children.pop(message["exited"], None)
            if process is not None:
                process.exited(message["code"])

    def _lost(self, why: str) -> None:
        """From now on children start by exec; those the server had die with it."""
        if self._refused is None:
            self._refused = why
            self.log.warning("children start by exec from now on", reason=why)
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        if self._sock is not None:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._sock)
        while self._pending:
            forked, read_end = self._pending.popleft()
            os.close(read_end)
            if not forked.done():
                forked.set_exception(OSError(why))
        for pid, process in list(self._children.items()):
            signal_group(pid, signal.SIGKILL)  # its death signal is on its way; make sure
            process.exited(-signal.SIGKILL)
        self._children.clear()
        if self._server is not None and self._server.poll() is None:
            self._server.kill()


# -- the server


def _preload(names: Sequence[str]) -> list[str]:
    """Import each; a failure is the child's to meet (it imports the module itself)."""
    failed = []
    for name in names:
        module_name, _, function = name.partition(":")
        try:
            module = importlib.import_module(module_name)
            if function:
                getattr(module, function)()
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return failed


def _threads() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 1


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(request: dict[str, Any], fds: list[int], keep_out: Sequence[int]) -> int:
    """The child's pid; the child itself never returns from here."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter's
        for fd in keep_out:
            os.close(fd)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # a PYTHONPATH of the child's own: its entries first, as an interpreter started
        # with it would have them
        entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        sys.path[:0] = [e for e in entries if e and e not in sys.path]
        sys.argv = [child.__file__, *request["args"]]
        code = child.main(request["args"])
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    child.exit_now(code)


def serve(sock: socket.socket) -> int:
    """Fork a child per request until the launcher closes its end."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wake_read, selectors.EVENT_READ, "reap")
    # a child closes what the server listens on (the selector's own descriptor included)
    keep_out = [sock.fileno(), wake_read, wake_write, selector.fileno()]
    while True:
        for key, _ in selector.select():
            if key.data == "reap":
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
                _reap(sock)
                continue
            data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            if not data:
                return 0
            try:
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise ValueError("a request longer than a packet")
                if len(fds) != 3:
                    raise ValueError(f"a request carries 3 descriptors, not {len(fds)}")
                pid = _fork(json.loads(data), fds, keep_out)
            except Exception as exc:
                _send(sock, {"unspawned": f"{type(exc).__name__}: {exc}"})
            else:
                _send(sock, {"spawned": pid})
            finally:
                for fd in fds:
                    os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pivot.bus.zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)
    launcher = os.getppid()
    child.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != launcher:
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its launcher decides when it ends
    os.dup2(2, 1)  # what a library prints (DeepSpeed logs to stdout) goes with its logs
    sock = socket.socket(fileno=args.fd)
    failed = _preload(args.preload)
    for line in failed:
        print(f"pivot.bus.zygote: preload failed: {line}", file=sys.stderr, flush=True)
    if (threads := _threads()) != 1:
        _send(sock, {"refused": f"{threads} threads after the preload (a fork copies one)"})
        return 1
    try:
        _send(sock, {"ready": os.getpid()})
        return serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the launcher closed its end first: nothing left to serve


if __name__ == "__main__":
    child.exit_now(main())
