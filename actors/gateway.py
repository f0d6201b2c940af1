"""The OpenAI-compatible HTTP gateway: agent code written against the ``openai`` client (or
any OpenAI-compatible framework) calls the policy through a base URL per session, and the
rollout gets back token-exact trajectories.

    async with Gateway(codec) as gateway:                 # 127.0.0.1, an ephemeral port
        base_url = gateway.open_session("s1", ctx.generate)
        await agent(AsyncOpenAI(base_url=base_url, api_key="none"))
        trajectories = gateway.close_session("s1")

Routes, under ``/s/<session>/v1``: ``POST /chat/completions``, ``POST /completions`` (both
streamed as server-sent events when asked) and ``GET /models``. Each request is read by
``pivot.openai_protocol``, turned into token ids by the session's ``pivot.chat_session``
bookkeeping (which says how re-sent history is matched against the tokens already held, and
the rule for edited history), and sent to the session's ``generate`` coroutine, the rollout's
``ctx.generate``. A stream is sent once its turn is generated. Errors are OpenAI's error
objects: 400 for a request that cannot be served, 404 for an unknown session or route, 500
when ``generate`` fails. The API key is not checked: the gateway listens on loopback only,
unless given another host.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import jinja2
import structlog
from aiohttp import web

from pivot.chat_session import ChatSession, Turn
from pivot.engines.tokenizer import TextCodec
from pivot.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    Reply,
    RequestError,
    chat_chunks,
    chat_completion,
    chat_request,
    completion,
    completion_chunks,
    completion_request,
    error_body,
    model_list,
)
from pivot.trajectory import Generation, Trajectory, TrajectoryError

log = structlog.get_logger("pivot.gateway")

LOOPBACK = "127.0.0.1"
DEFAULT_MODEL = "pivot-policy"  # what /v1/models lists; a request's own model name is echoed
MAX_BODY = 64 << 20  # bytes of one request
SESSION_ID = re.compile(r"[A-Za-z0-9._~-]+")  # unreserved URL characters: used as they are


class Generate(Protocol):
    """The rollout's ``ctx.generate``, called with token ids."""

    def __call__(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        stop_token_ids: Sequence[int] | None,
        seed: int | None,
        session: str | None,
    ) -> Awaitable[Generation]: ...


class _Session:
    def __init__(self, sid: str, generate: Generate, codec: TextCodec) -> None:
        self.sid = sid
        self.generate = generate
        self.tokens = ChatSession(codec)
        self.requests = 0


class Gateway:
    """The gateway's server and its sessions; ``start``/``close`` or ``async with``."""

    def __init__(
        self,
        codec: TextCodec,
        *,
        host: str = LOOPBACK,
        port: int = 0,
        model: str = DEFAULT_MODEL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.codec = codec
        self.host, self.port, self.model = host, port, model
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._runner: web.AppRunner | None = None
        # a long agent's history is re-sent every turn: aiohttp's 1 MiB default is too small
        self.app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY)
        prefix = "/s/{sid}/v1"
        self.app.router.add_post(f"{prefix}/chat/completions", self._chat)
        self.app.router.add_post(f"{prefix}/completions", self._completions)
        self.app.router.add_get(f"{prefix}/models", self._models)

    async def start(self) -> str:
        """Listen; returns the server's URL (the port is the one bound when given 0)."""
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("the gateway is not started")
        return f"http://{self.host}:{self.port}"

    def open_session(self, sid: str, generate: Generate) -> str:
        """Serve session ``sid`` through ``generate``; returns its OpenAI base URL."""
        if not SESSION_ID.fullmatch(sid):
            raise ValueError(f"a session id is letters, digits and ._~- only, not {sid!r}")
        if sid in self._sessions:
            raise ValueError(f"session {sid!r} is already open")
        url = f"{self.url}/s/{sid}/v1"
        self._sessions[sid] = _Session(sid, generate, self.codec)
        return url

    def session(self, sid: str) -> ChatSession:
        """The open session's token bookkeeping (its generations and trajectories so far)."""
        return self._sessions[sid].tokens

    def close_session(self, sid: str) -> list[Trajectory]:
        """End session ``sid``: its trajectories (usually one). A request still being
        generated for it gets a 404 when its generation returns."""
        return self._sessions.pop(sid).tokens.trajectories()

    # handlers

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as exc:
            return web.json_response(exc.body, status=exc.status)
        except web.HTTPException as exc:  # aiohttp's own: no such route, wrong method
            if exc.status < 400:
                raise
            body = error_body(f"{request.method} {request.path}: {exc.reason}", code=None)
            return web.json_response(body, status=exc.status)

    def _open(self, request: web.Request) -> _Session:
        sid = request.match_info["sid"]
        if sid not in self._sessions:
            raise RequestError(
                f"no open session {sid!r}", status=404, code="session_not_found", param=None
            )
        return self._sessions[sid]

    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not JSON", code="invalid_json") from None

    async def _models(self, request: web.Request) -> web.Response:
        self._open(request)
        return web.json_response(model_list(self.model, int(self._clock())))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._open(request)
        req = chat_request(await self._body(request), self.codec)
        try:
            turn = session.tokens.chat_turn(req.messages)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise RequestError(
                f"the policy's chat template cannot render the messages: {exc}",
                param="messages",
            ) from None
        reply = await self._generate(session, turn, req, "chatcmpl")
        if req.stream:
            return await self._stream(request, chat_chunks(reply, req, self.codec))
        return web.json_response(chat_completion(reply, req, self.codec))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._open(request)
        req = completion_request(await self._body(request), self.codec)
        turn = session.tokens.text_turn(req.prompt)
        reply = await self._generate(session, turn, req, "cmpl")
        if req.stream:
            return await self._stream(request, completion_chunks(reply, req, self.codec))
        return web.json_response(completion(reply, req, self.codec))

    async def _generate(
        self, session: _Session, turn: Turn, req: ChatRequest | CompletionRequest, kind: str
    ) -> Reply:
        if turn.segment is None and session.tokens.segments:
            log.info(
                "gateway request does not extend the session's tokens: a new segment",
                session=session.sid,
                segments=len(session.tokens.segments) + 1,
            )
        s = req.sampling
        session.requests += 1
        rid = f"{kind}-{session.sid}-{session.requests}"
        try:
            generation = await session.generate(
                turn.prompt_ids,
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                stop_token_ids=s.stop_token_ids,
                seed=s.seed,
                session=session.sid,
            )
        except Exception as exc:
            session.tokens.release(turn)
            log.warning("gateway generate failed", session=session.sid, error=repr(exc))
            raise RequestError(
                f"the policy could not generate: {type(exc).__name__}: {exc}",
                status=500,
                type="server_error",
                code=None,
            ) from None
        except BaseException:  # cancelled: the turn never happened
            session.tokens.release(turn)
            raise
        if self._sessions.get(session.sid) is not session:
            raise RequestError(
                f"session {session.sid!r} was closed while this turn was generated",
                status=404,
                code="session_not_found",
            )
        try:
            text = session.tokens.record(turn, generation, s.stop_token_ids or ())
        except TrajectoryError as exc:  # the engine answered something else than it was asked
            raise RequestError(str(exc), status=500, type="server_error", code=None) from None
        return Reply(
            id=rid,
            created=int(self._clock()),
            model=req.model or self.model,
            generation=generation,
            text=text,
        )

    async def _stream(self, request: web.Request, chunks: list[dict]) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
