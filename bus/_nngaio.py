"""Lean asyncio operations on nng sockets and contexts, reusing one nng_aio each.

pynng's ``arecv``/``asend`` allocate an nng_aio, a ``Message`` (with a lock) and a
shielded future on every call, and ask sniffio which event loop runs; that is a large
part of the 100-200 us a call costs. Here each ``AioSlot`` owns one nng_aio for its
whole life, completes a plain future through ``call_soon_threadsafe``, and lets nng
enforce receive timeouts itself (no asyncio timer per request).

This goes through pynng's cffi module (``pynng._nng``) and its completion callback
(``_async_complete`` looks callbacks up in ``pynng._aio._aio_map``). Those are not
public API: ``AVAILABLE`` is False when they are missing, and ``PublicAioSlot`` then
does the same job with pynng's public coroutines.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pynng

try:
    from pynng import _aio as _pynng_aio
    from pynng._nng import ffi, lib

    _CALLBACKS: dict[int, Any] = _pynng_aio._aio_map
    _COMPLETE = lib._async_complete
    _NONBLOCK = lib.NNG_FLAG_NONBLOCK
    _EAGAIN = lib.NNG_EAGAIN
    _ECANCELED = lib.NNG_ECANCELED
    AVAILABLE = isinstance(_CALLBACKS, dict)
except (ImportError, AttributeError):  # pragma: no cover - depends on pynng's internals
    AVAILABLE = False

_INFINITE = -1


def _check(err: int) -> None:
    if err:
        pynng.check_err(err)


class AioSlot:
    """One reusable nng_aio bound to the running loop. One operation at a time."""

    __slots__ = ("_aio", "_loop", "_future", "_generation", "_callback", "_key")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future[None] | None = None
        self._generation = 0
        self._callback = self._on_complete  # keep the bound method alive: its id is the key
        self._key = id(self._callback)
        pointer = ffi.new("nng_aio **")
        _check(lib.nng_aio_alloc(pointer, _COMPLETE, ffi.cast("void *", self._key)))
        self._aio = pointer[0]

    # runs on an nng thread
    def _on_complete(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._wake, self._generation)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    def _wake(self, generation: int) -> None:
        future = self._future
        if generation == self._generation and future is not None and not future.done():
            future.set_result(None)

    async def _wait(self) -> int:
        future = self._future
        assert future is not None
        try:
            await future
        except asyncio.CancelledError:
            lib.nng_aio_cancel(self._aio)
            lib.nng_aio_wait(self._aio)  # cffi releases the GIL, so the callback can run
            self._generation += 1
            raise
        self._generation += 1
        return lib.nng_aio_result(self._aio)

    def _arm(self, timeout_ms: int) -> None:
        self._future = self._loop.create_future()
        lib.nng_aio_set_timeout(self._aio, timeout_ms)
        _CALLBACKS[self._key] = self._callback

    async def send_ctx(self, ctx: pynng.Context, data: bytes, timeout_ms: int = _INFINITE) -> None:
        await self._send(lib.nng_ctx_send, ctx.context, data, timeout_ms)

    async def send_socket(
        self, sock: pynng.Socket, data: bytes, timeout_ms: int = _INFINITE
    ) -> None:
        await self._send(lib.nng_send_aio, sock.socket, data, timeout_ms)

    async def _send(self, start: Any, target: Any, data: bytes, timeout_ms: int) -> None:
        pointer = ffi.new("nng_msg **")
        _check(lib.nng_msg_alloc(pointer, 0))
        msg = pointer[0]
        err = lib.nng_msg_append(msg, data, len(data))
        if err:
            lib.nng_msg_free(msg)
            _check(err)
        lib.nng_aio_set_msg(self._aio, msg)
        self._arm(timeout_ms)
        start(target, self._aio)
        err = await self._wait_send()
        if err:
            # on failure nng hands the message back to us
            lib.nng_msg_free(lib.nng_aio_get_msg(self._aio))
            _check(err)

    async def _wait_send(self) -> int:
        try:
            return await self._wait()
        except asyncio.CancelledError:
            if lib.nng_aio_result(self._aio) != 0:
                lib.nng_msg_free(lib.nng_aio_get_msg(self._aio))
            raise

    async def recv_ctx(self, ctx: pynng.Context, timeout_ms: int = _INFINITE) -> bytes:
        return await self._recv(lib.nng_ctx_recv, ctx.context, timeout_ms)

    async def recv_socket(self, sock: pynng.Socket, timeout_ms: int = _INFINITE) -> bytes:
        return await self._recv(lib.nng_recv_aio, sock.socket, timeout_ms)

    async def _recv(self, start: Any, target: Any, timeout_ms: int) -> bytes:
        self._arm(timeout_ms)
        start(target, self._aio)
        _check(await self._wait())
        return _take(lib.nng_aio_get_msg(self._aio))

    def close(self) -> None:
        if self._aio is not None:
            lib.nng_aio_stop(self._aio)
            lib.nng_aio_free(self._aio)
            self._aio = None
            _CALLBACKS.pop(self._key, None)


def _take(msg: Any) -> bytes:
    data = ffi.unpack(ffi.cast("char *", lib.nng_msg_body(msg)), lib.nng_msg_len(msg))
    lib.nng_msg_free(msg)
    return data


def try_recv_socket(sock: pynng.Socket) -> bytes | None:
    """A frame already queued on ``sock``, or None: no event-loop round trip."""
    pointer = ffi.new("nng_msg **")
    err = lib.nng_recvmsg(sock.socket, pointer, _NONBLOCK)
    if err == _EAGAIN:
        return None
    _check(err)
    return _take(pointer[0])


class PublicAioSlot:
    """The same interface on pynng's coroutines (slower; used as a fallback).

    Cancelling one of pynng's pending ``arecv`` sometimes never returns, so callers
    close the socket (which ends every pending operation) before cancelling tasks.
    """

    async def send_ctx(self, ctx: pynng.Context, data: bytes, timeout_ms: int = _INFINITE) -> None:
        pynng.options._setopt_ms(ctx, "send-timeout", timeout_ms)
        await ctx.asend(data)

    async def send_socket(
        self, sock: pynng.Socket, data: bytes, timeout_ms: int = _INFINITE
    ) -> None:
        sock.send_timeout = timeout_ms
        await sock.asend(data)

    async def recv_ctx(self, ctx: pynng.Context, timeout_ms: int = _INFINITE) -> bytes:
        # nng enforces the timeout: cancelling a pending pynng arecv can hang
        pynng.options._setopt_ms(ctx, "recv-timeout", timeout_ms)
        return await ctx.arecv()

    async def recv_socket(self, sock: pynng.Socket, timeout_ms: int = _INFINITE) -> bytes:
        return await sock.arecv()

    def close(self) -> None:
        pass


def public_try_recv_socket(sock: pynng.Socket) -> bytes | None:
    try:
        return sock.recv(block=False)
    except pynng.TryAgain:
        return None


def new_slot(fast: bool) -> AioSlot | PublicAioSlot:
    return AioSlot() if fast and AVAILABLE else PublicAioSlot()
