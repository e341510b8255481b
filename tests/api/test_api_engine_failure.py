"""An engine that fails mid-request: a JSON 500 (or an in-band SSE error), a logged traceback, the KV cache
freed, and the node keeps serving. In-process, because breaking the engine needs access to it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo_like.api.routes import create_app
from exo_like.node import Node, NodeOptions
from tests.api_server import checkpoint  # noqa: F401  (fixture)


class EngineFault:
    """Makes the node's real engine raise on its `fail_at`-th step from now on."""

    def __init__(self, node: Node):
        assert node.instances.oldest().part.engine is not None
        self.engine = node.instances.oldest().part.engine
        self.real_step = self.engine.step
        self.calls = 0
        self.fail_at: int | None = None
        self.engine.step = self._step  # type: ignore[method-assign]

    def arm(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at

    def _step(self, items, inputs: np.ndarray):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            self.fail_at = None
            raise RuntimeError("simulated device failure")
        return self.real_step(items, inputs)


@pytest.fixture
async def served(checkpoint: Path, tmp_path: Path) -> AsyncIterator[tuple[TestClient, Node, EngineFault]]:  # noqa: F811
    node = Node(NodeOptions(home=tmp_path, engine="torch", dtype="float32", mdns=False, model=str(checkpoint)))
    async with TestClient(TestServer(create_app(node))) as client:
        await node.start("127.0.0.1", client.port)
        assert node.instances is not None
        await node.instances.oldest().wait_ready(60)
        yield client, node, EngineFault(node)
    await node.close()


def chat_body(model: str, **fields: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 10,
            "temperature": 0, **fields}


async def test_failure_in_a_whole_response_is_a_logged_json_500(served, caplog: pytest.LogCaptureFixture) -> None:
    client, node, fault = served
    model = node.lifecycle.served()[0].model_id
    fault.arm(fail_at=4)
    with caplog.at_level(logging.ERROR, logger="exo_like.api.routes"):
        response = await client.post("/v1/chat/completions", json=chat_body(model))
    assert response.status == 500
    body = await response.json()
    assert body["error"]["type"] == "server_error" and "simulated device failure" in body["error"]["message"]
    assert any("simulated device failure" in (r.exc_text or "") for r in caplog.records)
    assert node.status()["in_flight_requests"] == 0
    await _wait_for_no_caches(node)

    ok = await client.post("/v1/chat/completions", json=chat_body(model))
    assert ok.status == 200 and (await ok.json())["usage"]["completion_tokens"] == 10
    # A finished response ends with its KV blocks freed.
    assert node.status()["active_kv_caches"] == 0


async def test_failure_mid_stream_is_an_error_event_then_done(served) -> None:
    client, node, fault = served
    fault.arm(fail_at=5)
    model = node.lifecycle.served()[0].model_id
    response = await client.post("/v1/chat/completions", json=chat_body(model, stream=True))
    assert response.status == 200
    events = [line[len("data: "):] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error"
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(chunks) > 1  # text was streamed before the failure
    await _wait_for_no_caches(node)
    part = node.instances.oldest().part
    assert part.stage.scheduler is not None and part.stage.scheduler.pool.available == part.engine.kv_blocks


async def _wait_for_no_caches(node: Node) -> None:
    for _ in range(200):
        if node.status()["active_kv_caches"] == 0:
            break
        await asyncio.sleep(0.01)
    assert node.status()["active_kv_caches"] == 0
