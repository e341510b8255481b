"""The models' lifecycle: this project's own API to load and unload instances (the dashboard uses it), and Ollama's
/api/pull and /api/delete.

GET /v1/instances lists the instances as GET /v1/cluster shows them; POST /v1/instances {"model", "nodes"?} asks the
cluster to serve a model (on the nodes named, else where placement puts it) until it is unloaded by name, answering
202 at once (the picture shows its load; a model that cannot fit is refused, saying what it needs); DELETE
/v1/instances/{model} unloads it on every node (its running requests end with a 503).

POST /api/pull fetches a model's files into this node's cache, streaming Ollama's progress lines; DELETE /api/delete
removes a downloaded model from this node's cache (unloading it first if the cluster serves it). Both act on the
node asked, as Ollama acts on its one machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from exo_like.api.lifecycle import NODE_KEY, ndjson, read_json
from exo_like.api.ollama_api import NDJSON, ollama_errors
from exo_like.api.ollama_models import invalid, text
from exo_like.api.requests import optional_bool, require_object
from exo_like.errors import InvalidRequestError, ModelNotFoundError
from exo_like.models.hub.progress import DownloadStatus

PULL_PROGRESS_SECONDS = 0.5


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/instances", list_instances)
    app.router.add_post("/v1/instances", load_instance)
    app.router.add_delete("/v1/instances/{model:.+}", unload_instance)
    app.router.add_post("/api/pull", pull)
    app.router.add_delete("/api/delete", delete)


async def list_instances(request: web.Request) -> web.Response:
    picture = request.app[NODE_KEY].cluster_json() or {"instances": []}
    return web.json_response({"object": "list", "data": picture["instances"]})


async def load_instance(request: web.Request) -> web.Response:
    body = require_object(await read_json(request))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model is required: a non-empty string", param="model",
                                  code="missing_required_parameter")
    nodes = body.get("nodes") or []
    if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
        raise InvalidRequestError("nodes must be a list of node ids", param="nodes", code="invalid_type")
    node = request.app[NODE_KEY]
    members = {m["id"] for m in (node.cluster_json() or {"nodes": []})["nodes"]}
    unknown = [n for n in nodes if n not in members]
    if unknown:
        raise InvalidRequestError(f"no member of the cluster has the id {', '.join(unknown)}; GET /v1/cluster lists "
                                  "them", param="nodes", code="invalid_value")
    loaded, instance = await node.lifecycle.pin(model, tuple(nodes))
    return web.json_response({"model": loaded.model_id, "key": loaded.key, "id": instance, "nodes": nodes},
                             status=202)


async def unload_instance(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if not await request.app[NODE_KEY].lifecycle.unload(name):
        raise ModelNotFoundError(f"the model {name!r} is not loaded: GET /v1/instances lists the loaded ones")
    return web.json_response({"model": name, "unloaded": True})


async def pull(request: web.Request) -> web.StreamResponse:
    body = require_object(await read_json(request))
    name = text(body, "model") or text(body, "name")  # `name` is the field's old spelling
    if not name:
        raise invalid("model is required: a non-empty string", "model", "missing_required_parameter")
    stream = optional_bool(body, "stream")
    node = request.app[NODE_KEY]
    with ollama_errors(name):
        model = await node.models.prepare(name)  # the name resolved (the hub asked once) before anything streams
    fetching = asyncio.ensure_future(node.lifecycle.pull(model))
    if stream is False:
        with ollama_errors(name):
            await fetching
        return web.json_response({"status": "success"})
    response = web.StreamResponse(headers={"Content-Type": NDJSON})
    await response.prepare(request)
    try:
        await response.write(ndjson({"status": "pulling manifest"}))
        while not fetching.done():
            await asyncio.wait([fetching], timeout=PULL_PROGRESS_SECONDS)
            status = node.download_progress.status()
            if status is not None and status.state == "downloading":
                await response.write(ndjson(_progress(model.key, status)))
        try:
            fetching.result()
        except Exception as e:  # noqa: BLE001  (the client is told in Ollama's words, mid-stream)
            await response.write(ndjson({"error": getattr(e, "message", str(e))}))
        else:
            for status in ("verifying sha256 digest", "writing manifest", "success"):
                await response.write(ndjson({"status": status}))
        await response.write_eof()
    finally:
        fetching.cancel()
    return response


def _progress(key: str, status: DownloadStatus) -> dict[str, Any]:
    return {"status": f"pulling {key}", "digest": key, "total": status.total_bytes, "completed": status.done_bytes}


async def delete(request: web.Request) -> web.Response:
    body = require_object(await read_json(request))
    name = text(body, "model") or text(body, "name")
    if not name:
        raise invalid("model is required: a non-empty string", "model", "missing_required_parameter")
    with ollama_errors(name):
        await request.app[NODE_KEY].lifecycle.delete(name)
    return web.Response(status=200)
