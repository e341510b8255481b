"""A stage whose engine hangs while its node stays alive (so its link and heartbeats do too): requests through it
fail with a 504 once it has spent --step-timeout in one step, instead of waiting forever; once the engine comes
back, the ring serves again. In-process, because hanging an engine needs access to it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from discovery.static import PeerAddress
from exo_like.api.routes import create_app
from exo_like.node import Node, NodeOptions
from tests.api_server import checkpoint  # noqa: F401  (fixture)

STEP_TIMEOUT = 1.5
HANG_LIMIT = 60.0  # a hung step gives up by itself after this long, so a failing test cannot hang the suite


class Hang:
    """Makes a node's engine block inside its next step until `release()` (or HANG_LIMIT)."""

    def __init__(self, node: Node):
        self.real_step = node.instances.oldest().part.engine.step
        self.armed = False
        self.entered = threading.Event()
        self.released = threading.Event()
        self.over = threading.Event()  # the hung step has stopped waiting (released, or HANG_LIMIT passed)
        node.instances.oldest().part.engine.step = self._step  # type: ignore[method-assign]

    def arm(self) -> None:
        self.entered.clear()
        self.released.clear()
        self.over.clear()
        self.armed = True

    def release(self) -> None:
        self.released.set()

    def _step(self, items, inputs: np.ndarray):  # type: ignore[no-untyped-def]
        if self.armed:
            self.armed = False
            self.entered.set()
            self.released.wait(HANG_LIMIT)
            self.over.set()
        return self.real_step(items, inputs)


async def start_node(stack: AsyncExitStack, home: Path, model: Path, memory_gb: float,
                     peers: list[PeerAddress]) -> tuple[TestClient, Node]:
    node = Node(NodeOptions(home=home, engine="torch", dtype="float32", mdns=False, model=str(model),
                            memory_gb=memory_gb, peers=peers, step_timeout=STEP_TIMEOUT, node_name=home.name,
                            placement="memory"))  # both nodes a stage, whatever their measured speeds
    client = await stack.enter_async_context(TestClient(TestServer(create_app(node))))
    await node.start("127.0.0.1", client.port)
    stack.push_async_callback(node.close)
    return client, node


@pytest.fixture
async def ring(checkpoint: Path, tmp_path: Path) -> AsyncIterator[list[tuple[TestClient, Node]]]:  # noqa: F811
    """Two nodes (the first stage, then the last) linked over loopback."""
    async with AsyncExitStack() as stack:
        first = await start_node(stack, tmp_path / "first", checkpoint, 2.0, [])
        last = await start_node(stack, tmp_path / "last", checkpoint, 1.0, [PeerAddress("127.0.0.1", first[0].port)])
        for _, node in (first, last):
            assert node.instances is not None
            plan = await node.instances.oldest().wait_ready(60)
        assert plan.node_ids == [first[1].node_id, last[1].node_id]
        yield [first, last]


def chat_body(node: Node) -> dict[str, object]:
    assert node.lifecycle.served()
    return {"model": node.lifecycle.served()[0].model_id, "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 8, "temperature": 0}


def active_requests(nodes: list[Node]) -> int:
    return sum(i.part.stage.active_requests() for n in nodes for i in n.instances.instances.values())


async def wait_for_no_caches(nodes: list[Node]) -> None:
    deadline = time.monotonic() + 10
    while active_requests(nodes) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert active_requests(nodes) == 0


@pytest.mark.parametrize("hung_stage", [0, 1], ids=["origin's own stage", "a peer's stage"])
async def test_a_hung_stage_fails_the_request_with_a_504_and_the_ring_serves_once_it_recovers(
        ring: list[tuple[TestClient, Node]], hung_stage: int) -> None:
    (client, origin), (_, hung) = ring[0], ring[hung_stage]
    healthy = await client.post("/v1/chat/completions", json=chat_body(origin))
    assert healthy.status == 200
    expected = (await healthy.json())["choices"][0]["message"]["content"]

    hang = Hang(hung)
    hang.arm()
    started = time.monotonic()
    try:
        response = await client.post("/v1/chat/completions", json=chat_body(origin))
        waited = time.monotonic() - started
        body = await response.json()
        assert response.status == 504, body
        error = body["error"]
        assert error["code"] == "stage_stalled" and error["type"] == "server_error"
        assert f"node {hung.info.name} ({hung.node_id})" in error["message"] and "--step-timeout" in error["message"]
        # After the step had spent --step-timeout, and while the engine was still hung: the watchdog answered,
        # not the step's end (it cannot end before release() below, or HANG_LIMIT, far beyond the watchdog's
        # tick). Not timed against a clock a busy machine stretches.
        assert waited > STEP_TIMEOUT, waited
        assert hang.entered.is_set() and not hang.over.is_set()
        view = origin.cluster_json()
        assert view is not None
        # The view shows the step's seconds to a tenth: past the limit shows as at least the limit.
        assert next(n for n in view["nodes"] if n["id"] == hung.node_id)["step_seconds"] >= STEP_TIMEOUT
    finally:
        hang.release()
    await wait_for_no_caches([node for _, node in ring])
    recovered = await client.post("/v1/chat/completions", json=chat_body(origin))
    assert recovered.status == 200
    assert (await recovered.json())["choices"][0]["message"]["content"] == expected
