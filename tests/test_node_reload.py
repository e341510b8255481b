"""Loads replaced by newer plans: the range a node ends up holding is the newest plan's, and a load nobody
wants any more stops early instead of running to the end. In-process, because the race needs a slow load."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo_like.api.routes import create_app
from exo_like.engines.base import LoadCancelled
from exo_like.engines.choice import create_engine
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from exo_like.node import Node, NodeOptions
from partitioning import NodeCapacity
from partitioning.plan import make_plan
from tests.api_server import checkpoint  # noqa: F401  (fixture)

GIB = 1 << 30


async def test_a_load_cancelled_by_a_newer_plan_does_not_leave_its_range_behind(checkpoint: Path,  # noqa: F811
                                                                                tmp_path: Path) -> None:
    node = Node(NodeOptions(home=tmp_path, engine="torch", dtype="float32", mdns=False, model=str(checkpoint)))
    async with TestClient(TestServer(create_app(node))) as client:
        await node.start("127.0.0.1", client.port)
        assert node.instances is not None
        plan = await node.instances.oldest().wait_ready(60)
        whole = plan.shard_for(node.node_id)
        # A peer appears (the node starts loading its half) and vanishes again before that load is done.
        with_peer = make_plan(plan.model_id, plan.n_layers, [NodeCapacity(node.node_id, 2 * GIB),
                                                             NodeCapacity("peer", GIB)])
        half = with_peer.shard_for(node.node_id)
        assert whole is not None and half is not None and half != whole
        loading = threading.Event()
        real_load = node.instances.oldest().part.engine.load
        outcomes: list[str] = []

        def slow_load(*args: object) -> None:
            loading.set()
            time.sleep(0.3)
            try:
                real_load(*args)  # type: ignore[arg-type]
            except LoadCancelled:
                outcomes.append("cancelled")
                raise
            outcomes.append("loaded")

        node.instances.oldest().part.engine.load = slow_load  # type: ignore[method-assign]
        superseded = asyncio.ensure_future(node.instances.oldest().part.hold(with_peer, half))
        assert await asyncio.get_running_loop().run_in_executor(None, loading.wait, 10)
        superseded.cancel()
        await node.instances.oldest().part.hold(plan, whole)
        await asyncio.get_running_loop().run_in_executor(node.executor, lambda: None)  # engine thread idle
        assert node.instances.oldest().part.engine.shard == whole
        assert outcomes == ["cancelled", "loaded"]  # the superseded load gave up; the newest plan's range loaded

        response = await client.post("/v1/chat/completions", json={
            "model": node.lifecycle.served()[0].model_id, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3})
        assert response.status == 200, await response.text()
    await node.close()


class CancelledAfter(threading.Event):
    """A cancel event that reads as set from its `checks`+1-th look on: cancels a load part of the way in."""

    def __init__(self, checks: int):
        super().__init__()
        self.checks = checks
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks > self.checks


@pytest.mark.parametrize("engine_name", ["torch", "mlx"])
def test_an_engine_stops_a_cancelled_load_part_way_and_holds_nothing(checkpoint: Path,  # noqa: F811
                                                                     engine_name: str) -> None:
    pytest.importorskip(engine_name)
    args = ModelArgs.from_dir(checkpoint)
    whole = Shard("m", 0, args.num_hidden_layers, args.num_hidden_layers)
    engine = create_engine(engine_name, device="cpu", dtype="float32")
    engine.load(checkpoint, args, whole)
    cancel = CancelledAfter(checks=1)
    with pytest.raises(LoadCancelled):
        engine.load(checkpoint, args, whole, cancel)
    assert cancel.looks == 2  # it looked again after its first step, and stopped there
    assert engine.shard is None and engine.parameter_bytes() == 0
    engine.load(checkpoint, args, whole)  # and loads normally afterwards
    assert engine.shard == whole
