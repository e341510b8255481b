"""`--api-key`: who may use a node's HTTP API once any request can make the cluster download and load a model.

As llama.cpp's and vLLM's --api-key: every API route and the dashboard's data answer 401 (in the dialect's error
shape) unless the request presents the key, as OpenAI's and Ollama's clients send it (`Authorization: Bearer KEY`),
as Anthropic's does (`x-api-key: KEY`), or as the dashboard does (a SameSite=Strict cookie it sets once the user
typed the key, which its event stream sends too: a browser's EventSource cannot set headers).

Left open: the peer link (peers prove the cluster key in their own handshake), /health (liveness for load
balancers), and the dashboard's page and assets (no data: the page asks for the key).
"""

from __future__ import annotations

import hmac
from urllib.parse import unquote
from collections.abc import Iterator

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from exo_like.cluster.peers import PEER_PATH
from exo_like.errors import AuthenticationError

COOKIE = "exo_like_api_key"
OPEN_PATHS = frozenset({"/", "/health", PEER_PATH})
OPEN_PREFIXES = ("/dashboard/",)


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
