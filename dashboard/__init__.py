"""The dashboard every node serves: a static page (no build step, no CDN) and the event stream that feeds it.

Routes: GET / (the page, for clients that accept HTML), GET /dashboard/<file> (its assets),
GET /v1/events (server-sent events: the cluster picture on every change and at least once per second).
The cluster is reached through two callables, so this package does not depend on the node's internals.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from dashboard.events import Picture, WaitChange, add_event_routes

STATIC_DIR = (Path(__file__).parent / "static").resolve()
ASSET_PREFIX = "/dashboard/"

__all__ = ["STATIC_DIR", "add_routes", "page", "wants_html"]


def add_routes(app: web.Application, picture: Picture, wait_change: WaitChange) -> None:
    app.router.add_get(ASSET_PREFIX + "{name}", asset)
    add_event_routes(app, picture, wait_change)


def wants_html(request: web.Request) -> bool:
    """Browsers ask for text/html; curl and API clients get the JSON index instead."""
    return "text/html" in request.headers.get("Accept", "")


def page() -> web.FileResponse:
    return _file(STATIC_DIR / "index.html")


async def asset(request: web.Request) -> web.FileResponse:
    try:
        path = (STATIC_DIR / request.match_info["name"]).resolve()
        found = path.parent == STATIC_DIR and path.is_file()  # flat folder: no way out of it
    except (ValueError, OSError):  # a NUL in the name, or a name too long for the file system: no asset either
        found = False
    if not found:
        raise web.HTTPNotFound()
    return _file(path)


def _file(path: Path) -> web.FileResponse:
    # no-cache = revalidate every time: after an upgrade a node must never serve a stale script from cache.
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})
