"""GET /v1/events: the cluster picture as server-sent events, pushed on every change and at least once a second.

Every event is the whole picture (what GET /v1/cluster returns), so a client that missed events or reconnects
needs nothing else. `retry: 1000` makes EventSource reconnect within a second when its node restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)

Picture = Callable[[], "dict[str, Any] | None"]  # None while the node is still starting
WaitChange = Callable[[float], Awaitable[None]]  # returns at the next change, or after the timeout

EVENT_INTERVAL = 1.0  # at least one picture per second: throughput and "lost n s ago" keep moving
COALESCE_SECONDS = 0.05  # several peers' announcements often arrive together: send them as one picture
STREAMS_KEY = web.AppKey("event_streams", set)
SOURCE_KEY = web.AppKey("event_source", tuple)


def add_event_routes(app: web.Application, picture: Picture, wait_change: WaitChange) -> None:
    app[SOURCE_KEY] = (picture, wait_change)
    app[STREAMS_KEY] = set()
    app.router.add_get("/v1/events", events)
    app.on_shutdown.append(_close_streams)


async def events(request: web.Request) -> web.StreamResponse:
    picture, wait_change = request.app[SOURCE_KEY]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    task = asyncio.current_task()
    request.app[STREAMS_KEY].add(task)
    try:
        await response.write(b"retry: 1000\n\n")
        while True:
            current = picture()
            if current is not None:
                await response.write(f"event: cluster\ndata: {json.dumps(current)}\n\n".encode())
            await wait_change(EVENT_INTERVAL - COALESCE_SECONDS)
            await asyncio.sleep(COALESCE_SECONDS)
    except ConnectionResetError:
        log.debug("event stream to %s closed by the client", request.remote)
    except asyncio.CancelledError:
        # Client gone (handler cancellation) or the node is shutting down: either way the stream just ends.
        log.debug("event stream to %s cancelled", request.remote)
        raise
    finally:
        request.app[STREAMS_KEY].discard(task)
    return response


async def _close_streams(app: web.Application) -> None:
    """Event streams never end by themselves: end them at shutdown instead of making it wait for them."""
    streams = list(app[STREAMS_KEY])
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
