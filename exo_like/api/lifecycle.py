"""What every dialect's handler shares around a generation: the app's keys, reading a JSON body, the life of a
request (registered while it generates so shutdown can wait for it, logged once, counted in /metrics once, as soon
as its tokens are all out), streaming its events out (stream_out), and each dialect's error shape, picked by path."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from typing import Any

from aiohttp import web

from exo_like.api.choices import ChoiceSet
from exo_like.api.generation import TextGeneration
from exo_like.errors import ExoLikeError, InvalidRequestError
from exo_like.node import Node
from exo_like.serving.metrics import FinishedRequest

log = logging.getLogger(__name__)

NODE_KEY = web.AppKey("node", Node)
GENERATING_KEY = web.AppKey("generating", set)  # handler tasks of requests that are generating
# (status, message, type, param, code) -> the error body of a dialect
ErrorShape = Callable[[int, str, str, str | None, str | None], dict[str, Any]]
ERROR_SHAPES_KEY = web.AppKey("error_shapes", list)  # (path prefix, ErrorShape): the first match wins


def error_shape(app: web.Application, path: str) -> ErrorShape | None:
    """The error shape of the dialect serving `path` (None: OpenAI's)."""
    return next((shape for prefix, shape in app[ERROR_SHAPES_KEY] if path.startswith(prefix)), None)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, whatever the Content-Type says (curl -d sends form encoding by default)."""
    raw = await request.read()
    if not raw.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(
            f"the request body is not valid JSON ({e}); send a JSON object with Content-Type: application/json",
            code="invalid_json") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


@asynccontextmanager
async def generating(request: web.Request, choices: ChoiceSet, response_id: str) -> AsyncIterator[None]:
    """The span of a request's generation: shutdown waits for it; on the way out it is logged and counted (if its
    response did not count it already with `record`), and a disconnect is logged as one."""
    started = time.monotonic()
    task = asyncio.current_task()
    node = request.app[NODE_KEY]
    request.app[GENERATING_KEY].add(task)
    try:
        yield
    except asyncio.CancelledError:
        # The handler is cancelled when the client disconnects (or at shutdown); the generation is closed by now.
        reason = "the node is shutting down" if node.stopping else "client disconnected"
        log.info("request %s: %s after %d tokens; generation stopped", response_id, reason,
                 choices.usage()["completion_tokens"])
        raise
    finally:
        request.app[GENERATING_KEY].discard(task)
        _log_done(response_id, choices, time.monotonic() - started)
        record(node, choices)  # a request that failed or was cancelled


def record(node: Node, choices: ChoiceSet) -> None:
    """Count a request's generations in /metrics once: as soon as their tokens are all out (before the response
    ends, so a client that scrapes right after sees them), or when they end otherwise."""
    for generation in choices.generations:
        _record(node, generation)


def _record(node: Node, generation: TextGeneration) -> None:
    if generation.recorded:
        return
    generation.recorded = True
    node.metrics.observe_request(FinishedRequest(
        len(generation.prompt_tokens), generation.completion_tokens, generation.finish_reason or "abort",
        generation.started, tuple(generation.token_times), time.monotonic()))


def _log_done(response_id: str, choices: ChoiceSet, seconds: float) -> None:
    usage = choices.usage()
    finish = ",".join(g.finish_reason or "cancelled" for g in choices.generations)
    log.info("request %s: %d prompt + %d completion tokens, finish=%s, %.2fs (%.1f tok/s)", response_id,
             usage["prompt_tokens"], usage["completion_tokens"], finish, seconds,
             usage["completion_tokens"] / seconds if seconds > 0 else 0.0)


def sse(payload: dict[str, Any], named: bool = False) -> bytes:
    """A server-sent event of `payload` (with an `event:` line of its type, for dialects that name events)."""
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    return (f"event: {payload['type']}\n{data}" if named else data).encode()


def ndjson(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode() + b"\n"


async def stream_out(request: web.Request, choices: ChoiceSet, response_id: str,
                     events: AsyncIterator[dict[str, Any]], encode: Callable[[dict[str, Any]], bytes],
                     error_event: ErrorShape, content_type: str = "text/event-stream",
                     trailer: bytes = b"") -> web.StreamResponse:
    """Stream a generation's events, as every dialect does: once the status line is out, an error is an event of the
    dialect's error shape; a client that goes away stops the generation (its handler is cancelled: the events'
    generator closes, and with it the generation); a node shutting down says so before the stream ends; `trailer`
    (OpenAI's `data: [DONE]`) ends every stream that ends here."""
    response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    try:
        try:
            async with aclosing(events) as each:
                async for event in each:
                    await response.write(encode(event))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except ExoLikeError as e:
            await response.write(encode(error_event(e.status, e.message, e.type, e.param, e.code)))
        except Exception as e:
            log.exception("request %s failed while streaming", response_id)
            await response.write(encode(error_event(500, f"internal server error: {type(e).__name__}: {e}",
                                                    "server_error", None, None)))
        await response.write(trailer)
        await response.write_eof()
    except ConnectionResetError:
        log.info("request %s: client disconnected after %d tokens; generation stopped", response_id,
                 choices.usage()["completion_tokens"])
    except asyncio.CancelledError:
        if request.app[NODE_KEY].stopping:  # tell the client why its stream ends early
            with suppress(ConnectionResetError):
                await response.write(encode(error_event(503, "the node is shutting down", "service_unavailable", None,
                                                        "shutting_down")))
                await response.write(trailer)
                await response.write_eof()
        raise
    return response
