"""A node whose plan changes while it is still loading: the range it ends up holding is the newest plan's.
In-process, because the race needs a load that is slow on purpose."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from exo_like.api import create_app
from exo_like.node import Node, NodeOptions
from exo_like.plan import make_plan
from partitioning import NodeCapacity
from tests.api_server import checkpoint  # noqa: F401  (fixture)

GIB = 1 << 30


async def test_a_load_cancelled_by_a_newer_plan_does_not_leave_its_range_behind(checkpoint: Path,  # noqa: F811
                                                                                tmp_path: Path) -> None:
    node = Node(NodeOptions(home=tmp_path, engine="torch", dtype="float32", mdns=False, model=str(checkpoint)))
    async with TestClient(TestServer(create_app(node))) as client:
        await node.start("127.0.0.1", client.port)
        assert node.cluster is not None
        plan = await node.cluster.wait_ready(60)
        whole = plan.shard_for(node.node_id)
        # A peer appears (the node starts loading its half) and vanishes again before that load is done.
        with_peer = make_plan(plan.model_id, plan.n_layers, [NodeCapacity(node.node_id, 2 * GIB),
                                                             NodeCapacity("peer", GIB)])
        half = with_peer.shard_for(node.node_id)
        assert whole is not None and half is not None and half != whole
        loading = threading.Event()
        real_load = node.engine.load

        def slow_load(*args: object) -> None:
            loading.set()
            time.sleep(0.3)
            real_load(*args)  # type: ignore[arg-type]

        node.engine.load = slow_load  # type: ignore[method-assign]
        superseded = asyncio.ensure_future(node._load_shard(with_peer, half))
        assert await asyncio.get_running_loop().run_in_executor(None, loading.wait, 10)
        superseded.cancel()
        await node._load_shard(plan, whole)
        await asyncio.get_running_loop().run_in_executor(node.executor, lambda: None)  # engine thread idle
        assert node.engine.shard == whole

        response = await client.post("/v1/chat/completions", json={
            "model": node.model.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert response.status == 200, await response.text()
    await node.close()
