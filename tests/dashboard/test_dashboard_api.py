"""The dashboard's server side against real nodes: the page and its assets, /v1/events, and what /v1/cluster
adds for it (bytes per node, shared load, lost nodes, the cluster key's status)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from safetensors import safe_open

from dashboard.events import COALESCE_SECONDS, EVENT_INTERVAL, add_event_routes
from tests.api_server import NodeProcess, start_node, stop_nodes
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready

GIB = 1 << 30
HANG_SECONDS = 60.0  # only a guard against hanging: nothing asserted depends on how fast this machine is


@pytest.fixture(scope="module")
def seven_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama7", "llama", n_layers=7, max_shard_size="200KB")


@pytest.fixture(scope="module")
def two_nodes(seven_layers: Path, tmp_path_factory: pytest.TempPathFactory):
    # Placed by memory: the split is then fixed by the memories set here. The default, by measured speed, splits
    # by how busy the machine was while each node timed itself. An hour's --peer-timeout: the last test kills one
    # (see there).
    nodes = start_cluster(tmp_path_factory.mktemp("dashboard-api"), str(seven_layers), [2, 1],
                          extra=("--placement", "memory", "--peer-timeout", "3600"))
    wait_until_ready(nodes, members=2)
    yield nodes
    stop_nodes(nodes)


async def events(node: NodeProcess) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """(arrival time, picture) for every `cluster` event of the node's /v1/events stream."""
    async with aiohttp.ClientSession() as session:
        async with session.get(node.base_url + "/v1/events") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            name = None
            async for raw in response.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: ") and name == "cluster":
                    yield time.monotonic(), json.loads(line[len("data: "):])


# First the test with a node of its own, so the module's two are not started (idle) beside it; last the one
# that kills one of them.

def test_cluster_key_status_is_shown_never_the_key(seven_layers: Path, tmp_path: Path) -> None:
    key = "sesame-4f1c2a-open"
    node = start_node(tmp_path, str(seven_layers), "--no-mdns", "--cluster-key", key, "--dtype", "float32")
    try:
        view = cluster_of(node)
        assert view["cluster_key"] == "set"
        answers = [json.dumps(view), json.dumps(node.get_json("/health")), json.dumps(node.get_json("/")),
                   node.request("GET", "/", headers={"Accept": "text/html"})[2].decode()]
        assert not any(key in answer for answer in answers)
    finally:
        node.stop()


def test_browsers_get_the_page_and_its_assets_api_clients_the_json_index(two_nodes: list[NodeProcess]) -> None:
    node = two_nodes[0]
    status, headers, body = node.request("GET", "/", headers={"Accept": "text/html,application/xhtml+xml,*/*"})
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assets = re.findall(r'(?:src|href)="(/dashboard/[^"]+)"', page)
    assert {"/dashboard/app.js", "/dashboard/style.css", "/dashboard/favicon.svg"} <= set(assets)
    scripts = ["/dashboard/app.js", "/dashboard/chat.js", "/dashboard/topology.js", "/dashboard/util.js"]
    types = {".js": "javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for asset in set(assets) | set(scripts):
        status, headers, _ = node.request("GET", asset)
        assert status == 200, asset
        assert types[Path(asset).suffix] in headers["Content-Type"], (asset, headers["Content-Type"])
        assert headers["Cache-Control"] == "no-cache"
    for bad in ("/dashboard/missing.js", "/dashboard/..%2F__init__.py", "/dashboard/%2E%2E%2Fevents.py"):
        assert node.request("GET", bad)[0] == 404, bad
    index = node.get_json("/")  # no Accept header: the JSON index, as before
    assert index["node_id"] == cluster_of(node)["node_id"]


def tensor_bytes(checkpoint: Path) -> dict[str, int]:
    """Bytes per tensor, from safetensors' own reader (the oracle for the plan's footprint)."""
    sizes = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                assert tensor.get_dtype() == "F32"
                sizes[name] = math.prod(tensor.get_shape()) * 4
    return sizes


def expected_used_bytes(sizes: dict[str, int], start: int, end: int, n_layers: int) -> int:
    total = 0
    for name, size in sizes.items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer:
            total += size if start <= int(layer.group(1)) < end else 0
        elif name == "model.embed_tokens.weight":
            total += size if start == 0 else 0
        else:
            assert name in ("model.norm.weight", "lm_head.weight"), name
            total += size if end == n_layers else 0
    return total


def test_cluster_view_adds_bytes_per_node_memory_model_and_key_status(two_nodes: list[NodeProcess],
                                                                       seven_layers: Path) -> None:
    sizes = tensor_bytes(seven_layers)
    views = [cluster_of(node) for node in two_nodes]
    for view in views:
        stages = {s["node_id"]: (s["start_layer"], s["end_layer"]) for s in view["plan"]["stages"]}
        assert view["placement"]["mode"] == "memory"
        assert sorted(stages.values()) == [(0, 5), (5, 7)]  # 7 layers over 2 and 1 GiB
        used = {n["id"]: n["used_bytes"] for n in view["nodes"]}
        assert used == {node_id: expected_used_bytes(sizes, *stages[node_id], 7) for node_id in stages}
        assert view["model_bytes"] == sum(sizes.values()) == sum(used.values())
        assert view["total_memory_bytes"] == 3 * GIB
        assert view["model_name"] == seven_layers.name
        assert view["cluster_key"] == "default"
        assert view["departed"] == [] and view["waiting_for"] is None
        assert view["requests_in_flight"] == 0
    assert [v["nodes"] for v in views][0] == [v["nodes"] for v in views][1]  # the same numbers everywhere


async def test_events_push_the_whole_picture_again_and_again(two_nodes: list[NodeProcess]) -> None:
    """How often is the stream's own schedule (test_the_event_stream_waits_at_most_a_second_between_pictures):
    timed here, it would time how busy the machine is."""
    fields = cluster_of(two_nodes[0]).keys()
    pictures = 0
    async with asyncio.timeout(HANG_SECONDS), contextlib.aclosing(events(two_nodes[0])) as stream:
        async for _, picture in stream:
            assert picture.keys() == fields
            assert len(picture["nodes"]) == 2 and picture["ready"]
            pictures += 1
            if pictures == 4:
                break


async def test_the_event_stream_waits_at_most_a_second_between_pictures() -> None:
    """Between two pictures the stream waits for a change for no longer than EVENT_INTERVAL, less the pause it
    takes to coalesce changes: a picture at least every second however seldom the cluster changes. Checked on
    what the stream asks to wait for, not on a clock a busy machine stretches."""
    waits: list[float] = []

    async def no_change(timeout: float) -> None:  # returns at once, as if the timeout had passed
        waits.append(timeout)

    app = web.Application()
    add_event_routes(app, lambda: {"picture": len(waits)}, no_change)
    async with TestClient(TestServer(app)) as client, asyncio.timeout(HANG_SECONDS):
        response = await client.get("/v1/events")
        seen = []
        async for line in response.content:
            if line.startswith(b"data: "):
                seen.append(json.loads(line[len(b"data: "):]))
                if len(seen) == 3:
                    break
        response.close()
    assert [picture["picture"] for picture in seen] == [0, 1, 2]  # one picture per wait
    assert waits and all(wait + COALESCE_SECONDS <= EVENT_INTERVAL for wait in waits), waits


async def poll_cluster(node: NodeProcess, condition, timeout: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Poll /v1/cluster until condition(view) holds; the last view either way (the caller asserts)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(node.base_url + "/v1/cluster") as response:
                view = await response.json()
            if condition(view) or time.monotonic() > deadline:
                return view
            await asyncio.sleep(0.1)


def generating(view: dict[str, Any], origin_id: str) -> bool:
    nodes = {n["id"]: n for n in view["nodes"]}
    origin = nodes[origin_id]
    return (view["requests_in_flight"] == 1 and view["tokens_per_second"] > 0 and origin["in_flight"] == 1
            and origin["generated_per_second"] > 0
            and all(n["busy"] and n["tokens_per_second"] > 0 and (n["decode_step_ms"] or 0) > 0  # None: no step yet
                    for n in nodes.values()))


def idle(view: dict[str, Any]) -> bool:
    return (view["requests_in_flight"] == 0 and view["tokens_per_second"] == 0
            and not any(n["busy"] or n["tokens_per_second"] or n["in_flight"] for n in view["nodes"]))


async def test_every_node_shows_every_nodes_live_load(two_nodes: list[NodeProcess], seven_layers: Path) -> None:
    origin, observer = two_nodes[1], two_nodes[0]
    origin_id = cluster_of(origin)["node_id"]
    body = {"model": seven_layers.name, "messages": [{"role": "user", "content": "Hello"}], "stream": True,
            "max_tokens": 100_000, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(origin.base_url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.content.readline()  # generating
            # Seen from the other node, so the origin's numbers can only have come in its announcements.
            view = await poll_cluster(observer, lambda v: generating(v, origin_id), timeout=5)
            assert generating(view, origin_id), view
        # Leaving the block closed the stream: the request is cancelled everywhere.
    view = await poll_cluster(observer, idle, timeout=5)
    assert idle(view), view


async def test_a_killed_node_is_shown_unreachable_and_the_new_plan_at_once(two_nodes: list[NodeProcess]) -> None:
    """At once: by its closed connection. Silence cannot count it lost while the test runs (an hour's
    --peer-timeout), so a loss shown at all was seen from the connection, however busy the machine is. On the
    module's two nodes, so the last test here that uses them."""
    nodes = two_nodes
    wait_until_ready(nodes, members=2)
    lost_id = cluster_of(nodes[1])["node_id"]
    killed = False
    async with asyncio.timeout(HANG_SECONDS), contextlib.aclosing(events(nodes[0])) as stream:
        async for _, picture in stream:
            if not killed:  # connected: now kill
                nodes[1].process.send_signal(signal.SIGKILL)
                killed = True
            elif picture["departed"]:
                break
    assert [(n["id"], n["status"], n["name"]) for n in picture["departed"]] == [(lost_id, "unreachable", "node1")]
    assert [n["id"] for n in picture["nodes"]] == [picture["node_id"]]
    assert [(s["start_layer"], s["end_layer"]) for s in picture["plan"]["stages"]] == [(0, 7)]
