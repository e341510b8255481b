"""The HTTP app every node serves (aiohttp): the node's own routes, with the dialects' (openai_api, responses_api,
anthropic_api, ollama_api) and the model instances' (instances_api) mounted beside them.

Routes here: GET /health, GET /v1/debug/requests, GET /v1/cluster, GET /metrics, what peers fetch from this node,
and the dashboard (GET /, its assets, GET /v1/events).
Every error, including unknown routes and wrong methods, is an error body in the shape of the dialect its path
belongs to (OpenAI's by default); bad input is always a 4xx. With --api-key, every route but a few open ones asks
for the key (below). Generation stops and frees its KV cache as soon as the client goes away.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Iterator
from typing import BinaryIO
from urllib.parse import unquote

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

import dashboard
from exo_like.api import anthropic_api, instances_api, ollama_api, openai_api, responses_api
from exo_like.api.lifecycle import ERROR_SHAPES_KEY, GENERATING_KEY, NODE_KEY, error_shape
from exo_like.api.openai_api import error_body
from exo_like.cluster.peers import PEER_PATH
from exo_like.models.hub.peer_files import (
    NODE_HEADER,
    PEER_DESCRIPTIONS_PATH,
    PEER_FILES_PATH,
    PEER_NAMES_PATH,
    PROOF_HEADER,
    WAIT_HEADER,
    growing_file,
    held_description,
    held_file,
    proven,
)
from exo_like.models.hub.repo import storage_folder
from exo_like.errors import AuthenticationError, ExoLikeError, ServiceUnavailableError
from exo_like.node import Node
from exo_like.serving.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # a full long-context prompt, JSON-escaped, fits comfortably
SHUTDOWN_GRACE = 5.0  # seconds requests still generating get to finish on shutdown before they are cancelled


def create_app(node: Node, api_key: str | None = None) -> web.Application:
    """The node's app; with `api_key`, every route but the open ones (OPEN_PATHS below) requires it."""
    guard = [api_key_middleware(api_key)] if api_key else []
    app = web.Application(middlewares=[error_middleware, *guard], client_max_size=MAX_BODY_BYTES)
    app[NODE_KEY] = node
    app[GENERATING_KEY] = set()
    app[ERROR_SHAPES_KEY] = []
    app.on_shutdown.append(finish_generations)  # if serving ends another way than serve()'s own shutdown
    openai_api.add_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/debug/requests", debug_requests)
    app.router.add_get("/v1/cluster", cluster_view)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(PEER_PATH, peer_link)
    app.router.add_get(PEER_FILES_PATH + "/{org}/{repo}/{commit}/{name:.+}", peer_file)
    app.router.add_get(PEER_DESCRIPTIONS_PATH + "/{org}/{repo}/{commit}", peer_description)
    app.router.add_get(PEER_NAMES_PATH, peer_name)
    app.router.add_get("/", index)
    for dialect in (anthropic_api, responses_api, ollama_api, instances_api):
        dialect.add_routes(app)
    dashboard.add_routes(app, node.cluster_json, node.wait_cluster_change)
    return app


# -- --api-key ---------------------------------------------------------------------------------------------------
# Who may use a node's HTTP API once any request can make the cluster download and load a model. As llama.cpp's and
# vLLM's --api-key: every API route and the dashboard's data answer 401 (in the dialect's error shape) unless the
# request presents the key, as OpenAI's and Ollama's clients send it (`Authorization: Bearer KEY`), as Anthropic's
# does (`x-api-key: KEY`), or as the dashboard does (a SameSite=Strict cookie it sets once the user typed the key,
# which its event stream sends too: a browser's EventSource cannot set headers). Left open: the peer link (peers
# prove the cluster key in their own handshake), /health (liveness for load balancers), and the dashboard's page and
# assets (no data: the page asks for the key).

COOKIE = "exo_like_api_key"
OPEN_PATHS = frozenset({"/", "/health", PEER_PATH, PEER_NAMES_PATH})
# peer files and descriptions: peers prove the cluster key instead
OPEN_PREFIXES = ("/dashboard/", PEER_FILES_PATH + "/", PEER_DESCRIPTIONS_PATH + "/")


def presented_keys(request: web.Request) -> Iterator[str]:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        yield token.strip()
    if "x-api-key" in request.headers:
        yield request.headers["x-api-key"].strip()
    if COOKIE in request.cookies:
        yield unquote(request.cookies[COOKIE])  # the page stores it URI-encoded (a cookie cannot hold ";")


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def api_key_middleware(key: str) -> Middleware:
    """Refuses every request to a guarded path that does not present `key` (compared in constant time)."""
    expected = key.encode()

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_open(request.path):
            return await handler(request)
        presented = list(presented_keys(request))
        if any(hmac.compare_digest(candidate.encode(), expected) for candidate in presented):
            return await handler(request)
        raise AuthenticationError("incorrect API key" if presented else
                                  "this node requires an API key: send it as `Authorization: Bearer <key>` (or "
                                  "`x-api-key: <key>`)")

    return require_api_key


async def finish_generations(app: web.Application) -> None:
    """On shutdown (no new connections any more): let running generations finish briefly, then cancel them.

    Run it before aiohttp's own shutdown, which stops reading every connection this node accepted: peer links
    included, so the ring would stall under the very requests the grace period is for."""
    app[NODE_KEY].stopping = True
    tasks: set[asyncio.Task[object]] = set(app[GENERATING_KEY])
    if not tasks:
        return
    log.info("waiting up to %.0fs for %d request(s) still generating", SHUTDOWN_GRACE, len(tasks))
    _, late = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, type_, param, code), status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ExoLikeError as e:
        # The path as sent (percent-encoded): decoded, a %0A in it would start a forged line of this log.
        log.info("%s %s -> %d %s", request.method, request.rel_url.raw_path, e.status, e.message)
        retry_after = getattr(e, "retry_after", None)
        return _error(request, e.status, e.message, e.type, e.param, e.code,
                      {"Retry-After": str(retry_after)} if retry_after is not None else None)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _http_error(request, e)
    except Exception as e:
        log.exception("unexpected error handling %s %s", request.method, request.rel_url.raw_path)
        return _error(request, 500, f"internal server error: {type(e).__name__}: {e}", "server_error")


def _error(request: web.Request, status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """An error in the shape of the dialect the path belongs to (OpenAI's by default)."""
    shape = error_shape(request.app, request.path)
    if shape is None:
        return error_response(status, message, type_, param, code, headers)
    return web.json_response(shape(status, message, type_, param, code), status=status, headers=headers)


def _http_error(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's own errors (404, 405, 413, ...) in the OpenAI error shape."""
    headers = None
    if isinstance(e, web.HTTPMethodNotAllowed):
        headers = {"Allow": ", ".join(sorted(e.allowed_methods))}
        message = f"method {request.method} is not allowed for {request.path}; use {headers['Allow']}"
    elif isinstance(e, web.HTTPNotFound):
        message = f"no route {request.method} {request.path}"
    else:
        message = e.text or e.reason
    code = e.reason.lower().replace(" ", "_")
    return _error(request, e.status, message, "invalid_request_error", None, code, headers)


async def health(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE_KEY].status())


async def debug_requests(request: web.Request) -> web.Response:
    """In-flight requests and KV caches: what the dashboard shows, and how tests see a cancelled request."""
    node = request.app[NODE_KEY]
    return web.json_response({"requests": node.reports.in_flight(), **node.reports.generation_stats()})


async def cluster_view(request: web.Request) -> web.Response:
    """The same picture on every node: members, the plan, and whether all members agree on it."""
    picture = request.app[NODE_KEY].cluster_json()
    if picture is None:
        raise ServiceUnavailableError("the node is still starting")
    return web.json_response(picture)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format, vLLM's metric names with the prefix exo_like: (see exo_like/serving/metrics.py)."""
    return web.Response(body=request.app[NODE_KEY].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


# -- what peers fetch from this node (models/hub/peer_files.py) --------------------------------------------------


def proven_peer(request: web.Request) -> Node:
    """The node, once the asking peer proved the cluster key for this path."""
    node = request.app[NODE_KEY]
    if not proven(node.options.cluster_key, request.headers.get(NODE_HEADER, ""), request.rel_url.raw_path,
                  request.headers.get(PROOF_HEADER, "")):
        raise web.HTTPForbidden(reason="no proof of the cluster key")
    return node


async def peer_file(request: web.Request) -> web.StreamResponse:
    """A file this node's cache holds whole; to the peer waiting for this node to fetch it, the file as it grows
    (503 + Retry-After while queued); 404 otherwise, so the peer asks another source."""
    node = proven_peer(request)
    info = request.match_info
    repo_id, commit, name = f"{info['org']}/{info['repo']}", info["commit"], info["name"]
    held = held_file(storage_folder(node.cache_dir, repo_id) / "snapshots", commit, name)
    if held is not None:
        return web.FileResponse(held)
    sharing = node.downloader.sharing(repo_id, commit, name) if WAIT_HEADER in request.headers else None
    if sharing is None:
        raise web.HTTPNotFound(reason="not held here")
    try:
        part = open(sharing.part, "rb") if sharing.part is not None else None  # noqa: SIM115 - closed below
    except FileNotFoundError:  # done just now (moved into place), or not begun
        part = None
    if part is None:
        held = held_file(storage_folder(node.cache_dir, repo_id) / "snapshots", commit, name)
        if held is not None:
            return web.FileResponse(held)
        raise web.HTTPServiceUnavailable(reason="fetching it soon", headers={"Retry-After": "1"})
    with part:
        return await stream_growing(request, part, sharing.size, sharing.finished)


async def stream_growing(request: web.Request, part: BinaryIO, size: int,
                         finished: Callable[[], bool]) -> web.StreamResponse:
    start = request.http_range.start or 0
    response = web.StreamResponse(status=206 if start else 200)
    response.content_length = size - start
    if start:
        response.headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
    await response.prepare(request)
    async for chunk in growing_file(part, start, size, finished):
        await response.write(chunk)
    return response


async def peer_description(request: web.Request) -> web.Response:
    """A commit's description (manifest, small files held), for a peer that would otherwise ask the hub."""
    node = proven_peer(request)
    info = request.match_info
    described = held_description(node.cache_dir, f"{info['org']}/{info['repo']}", info["commit"])
    if described is None:
        raise web.HTTPNotFound(reason="not held here")
    return web.json_response(described)


async def peer_name(request: web.Request) -> web.Response:
    """The key a hub name resolves to on this node without the hub, for a peer that cannot reach it."""
    node = proven_peer(request)
    key = node.models.key_on_disk(request.query.get("name", ""))
    if key is None:
        raise web.HTTPNotFound(reason="not known here")
    return web.json_response({"key": key})


async def peer_link(request: web.Request) -> web.StreamResponse:
    peers = request.app[NODE_KEY].peers
    if peers is None:
        raise ServiceUnavailableError("the node is still starting")
    return await peers.accept(request)


async def index(request: web.Request) -> web.StreamResponse:
    """The dashboard for browsers; a small JSON index for API clients."""
    if dashboard.wants_html(request):
        return dashboard.page()
    node = request.app[NODE_KEY]
    return web.json_response({"name": "exo-like", "node_id": node.node_id,
                              "api": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                      "/api/chat", "/api/generate", "/v1/models", "/health"]})
