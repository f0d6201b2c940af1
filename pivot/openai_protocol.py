"""The OpenAI API as pivot's gateway speaks it: request bodies read into what pivot samples
with (``chat_request``, ``completion_request``), and the response bodies and stream chunks
made of a ``Generation``. A body it cannot serve raises ``RequestError``: the HTTP status and
OpenAI's error object (``message``, ``type``, ``param``, ``code``).

Read: ``messages`` (text content, or text content parts), ``prompt`` (text or token ids, one
of them), ``max_completion_tokens`` / ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop`` (each sequence must be one token of the policy's tokenizer: the engine stops on
tokens, and a longer stop would leave tokens in the trajectory that the reply hides),
``stream``, ``stream_options.include_usage``, ``logprobs`` (the sampled token's logprob;
engines give no alternatives, so ``top_logprobs`` and a completion's ``logprobs`` above 0 are
refused). Refused with 400 and the parameter named: ``n`` or ``best_of`` above 1, penalties,
``logit_bias``, ``tools`` / ``functions``, tool calls in messages, a ``response_format``
other than text, ``echo``, ``suffix``. Other fields (``model``, ``user``, ``metadata``, ...)
are ignored. Every sampled token's logprob is returned, a final stop token's included, while
the reply text leaves a final stop token out, as OpenAI's does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec

from pivot.trajectory import Generation

if TYPE_CHECKING:
    from pivot.engines.tokenizer import TextCodec

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TEMPERATURE = 2.0  # OpenAI's range for temperature is [0, 2]


class RequestError(Exception):
    """A request the gateway does not serve; ``body`` is OpenAI's error object for it."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = "invalid_value",
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type=type, param=param, code=code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code=None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling a request asked for; None: the rollout's default."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None


class Request(msgspec.Struct, frozen=True, kw_only=True):
    sampling: Sampling
    model: str | None = None
    stream: bool = False
    include_usage: bool = False  # stream a last chunk with the token counts
    logprobs: bool = False


class ChatRequest(Request, frozen=True, kw_only=True):
    messages: list[dict[str, Any]]  # each {"role", "content"} (and "name" where given)


class CompletionRequest(Request, frozen=True, kw_only=True):
    prompt: str | list[int]


def chat_request(body: Any, codec: TextCodec) -> ChatRequest:
    body = _object(body)
    if body.get("n") not in (None, 1):
        raise _unsupported("n", "n above 1 is not served: send one request per sample")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs", "the engine returns the sampled token's logprob only")
    for name in ("tools", "functions"):
        if body.get(name):
            raise _unsupported(name, f"{name} are not served: describe them in the messages")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _unsupported("response_format", "only text responses are served")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        logprobs=_flag(body, "logprobs"),
        **_common(body, codec),
    )


def completion_request(body: Any, codec: TextCodec) -> CompletionRequest:
    body = _object(body)
    for name, default in (("n", 1), ("best_of", 1), ("echo", False), ("suffix", None)):
        if body.get(name) not in (None, default):
            raise _unsupported(name, f"{name} is not served")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise _unsupported(
            "logprobs", "the engine returns the sampled token's logprob only: ask for logprobs=0"
        )
    return CompletionRequest(
        prompt=_prompt(body.get("prompt")), logprobs=logprobs == 0, **_common(body, codec)
    )


def _common(body: dict[str, Any], codec: TextCodec) -> dict[str, Any]:
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, f"{name} is not served")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "logit_bias is not served")
    limit = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    model = body.get("model")
    return {
        "sampling": Sampling(
            max_new_tokens=_integer(body, limit, low=1),
            temperature=_number(body, "temperature", 0.0, MAX_TEMPERATURE),
            top_p=_number(body, "top_p", 0.0, 1.0, open_low=True),
            seed=_integer(body, "seed", low=0),
            stop_token_ids=_stops(body.get("stop"), codec),
        ),
        "model": model if isinstance(model, str) else None,
        "stream": _flag(body, "stream"),
        "include_usage": bool(options and options.get("include_usage")),
    }


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_type")
    return body


def _unsupported(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code="unsupported_parameter")


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, not {value!r}", param=name)
    return bool(value)


def _integer(body: dict[str, Any], name: str, *, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RequestError(f"{name} must be an integer >= {low}, not {value!r}", param=name)
    return value


def _number(
    body: dict[str, Any], name: str, low: float, high: float, *, open_low: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low < value if open_low else low <= value) or value > high:
        bounds = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise RequestError(f"{name} must be a number in {bounds}, not {value!r}", param=name)
    return float(value)


def _stops(value: Any, codec: TextCodec) -> tuple[int, ...] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop takes at most {MAX_STOP} sequences", param="stop")
    ids = []
    for s in stops:
        encoded = codec.encode(s, bos=False)
        if len(encoded) != 1:
            raise _unsupported(
                "stop", f"{s!r} is {len(encoded)} tokens of the policy's tokenizer, not one"
            )
        ids.append(encoded[0])
    return tuple(ids)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        raise RequestError(
            "messages is required", param="messages", code="missing_required_parameter"
        )
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} must be an object with a role", param=where)
        if m.get("tool_calls") or m.get("function_call"):
            raise _unsupported(f"{where}.tool_calls", "tool calls are not served")
        message = {"role": m["role"], "content": _content(m.get("content"), f"{where}.content")}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def _content(value: Any, where: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(p["text"] for p in value)
    raise RequestError(f"{where} must be text or text parts", param=where, code="unsupported_value")


def _prompt(value: Any) -> str | list[int]:
    if value is None:
        raise RequestError("prompt is required", param="prompt", code="missing_required_parameter")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise RequestError("prompt is empty", param="prompt")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return list(value)
    raise RequestError(
        "prompt must be one text or one array of token ids (batches are not served)",
        param="prompt",
    )


# responses


def usage(generation: Generation) -> dict[str, int]:
    prompt, completion = len(generation.prompt_ids), len(generation.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _pieces(codec: TextCodec, generation: Generation) -> list[str]:
    return [codec.decode([t], special=True) for t in generation.token_ids]


def _chat_logprobs(codec: TextCodec, generation: Generation) -> dict[str, Any]:
    content = [
        {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
        for piece, lp in zip(_pieces(codec, generation), generation.logprobs, strict=True)
    ]
    return {"content": content, "refusal": None}


def _text_logprobs(codec: TextCodec, generation: Generation, offset: int) -> dict[str, Any]:
    pieces = _pieces(codec, generation)
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": list(generation.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """One answered request: what the response bodies are made of."""

    id: str
    created: int
    model: str
    generation: Generation
    text: str  # the reply (a final stop token left out)


def chat_completion(reply: Reply, request: ChatRequest, codec: TextCodec) -> dict[str, Any]:
    g = reply.generation
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": reply.text},
        "logprobs": _chat_logprobs(codec, g) if request.logprobs else None,
        "finish_reason": str(g.finish_reason),
    }
    return {**_head(reply, "chat.completion"), "choices": [choice], "usage": usage(g)}


def chat_chunks(reply: Reply, request: ChatRequest, codec: TextCodec) -> list[dict[str, Any]]:
    """The stream of one reply: the role, the content (the whole turn is generated before
    the first chunk is sent), the finish reason, and the usage when asked."""
    g = reply.generation
    head = _head(reply, "chat.completion.chunk")
    logprobs = _chat_logprobs(codec, g) if request.logprobs else None

    def chunk(delta: dict[str, Any], finish: str | None = None, lp=None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**head, "choices": [choice], **({"usage": None} if request.include_usage else {})}

    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": reply.text}, lp=logprobs),
        chunk({}, str(g.finish_reason)),
    ]
    if request.include_usage:
        chunks.append({**head, "choices": [], "usage": usage(g)})
    return chunks


def completion(reply: Reply, request: CompletionRequest, codec: TextCodec) -> dict[str, Any]:
    g = reply.generation
    choice = {
        "index": 0,
        "text": reply.text,
        "logprobs": _text_logprobs(codec, g, _offset(request)) if request.logprobs else None,
        "finish_reason": str(g.finish_reason),
    }
    return {**_head(reply, "text_completion"), "choices": [choice], "usage": usage(g)}


def completion_chunks(
    reply: Reply, request: CompletionRequest, codec: TextCodec
) -> list[dict[str, Any]]:
    g = reply.generation
    head = _head(reply, "text_completion")
    logprobs = _text_logprobs(codec, g, _offset(request)) if request.logprobs else None

    def chunk(text: str, finish: str | None, lp=None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**head, "choices": [choice], **({"usage": None} if request.include_usage else {})}

    chunks = [chunk(reply.text, None, logprobs), chunk("", str(g.finish_reason))]
    if request.include_usage:
        chunks.append({**head, "choices": [], "usage": usage(g)})
    return chunks


def model_list(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "pivot"}],
    }


def _offset(request: CompletionRequest) -> int:
    # OpenAI's text offsets count from the start of the prompt's text
    return len(request.prompt) if isinstance(request.prompt, str) else 0


def _head(reply: Reply, kind: str) -> dict[str, Any]:
    return {"id": reply.id, "object": kind, "created": reply.created, "model": reply.model}
