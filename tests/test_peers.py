"""Peer links over real loopback sockets: authentication, refusal, duplicates, frame limits, loss."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web

from exo_like.peers import NodeInfo, PeerLink, PeerNetwork
from exo_like.wire import FrameError


class Peer:
    """A PeerNetwork behind a real aiohttp server on 127.0.0.1, recording what it receives."""

    def __init__(self, node_id: str, key: str, max_frame: int = 1 << 20, dtype: str | None = None):
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.changes = 0
        self.info = NodeInfo(node_id, f"name-{node_id}", "127.0.0.1", 0, "torch", "cpu", "test", 1 << 30, "0", dtype)
        self.net = PeerNetwork(self.info, key, self._handle, self._changed, max_frame_bytes=max_frame)
        self.port = 0

    async def _handle(self, link: PeerLink, message: dict[str, Any]) -> None:
        self.received.append((link.remote.node_id, message))

    def _changed(self) -> None:
        self.changes += 1

    async def start(self) -> None:
        app = web.Application()
        self.net.add_routes(app)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self.net.close()
        await self.runner.cleanup()


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def peers():
    started: list[Peer] = []

    async def make(node_id: str, key: str = "secret", **kwargs) -> Peer:
        peer = Peer(node_id, key, **kwargs)
        await peer.start()
        started.append(peer)
        return peer

    yield make
    for peer in started:
        await peer.stop()


async def test_link_exchanges_info_and_frames_both_ways(peers) -> None:
    a, b = await peers("aaa", dtype="float32"), await peers("bbb")
    link = await a.net.dial("127.0.0.1", b.port)
    assert link is not None and link.remote.name == "name-bbb" and link.remote.dtype is None
    await wait_for(lambda: b.net.linked("aaa"))
    assert b.net.links["aaa"].remote.memory_bytes == 1 << 30
    assert b.net.links["aaa"].remote.dtype == "float32"  # the fit check needs it: --dtype changes a node's bytes
    await a.net.send("bbb", {"type": "ping", "data": b"\x00\xff" * 10})
    await b.net.send("aaa", {"type": "pong", "n": 3})
    await wait_for(lambda: a.received and b.received)
    assert b.received == [("aaa", {"type": "ping", "data": b"\x00\xff" * 10})]
    assert a.received == [("bbb", {"type": "pong", "n": 3})]


async def test_wrong_cluster_key_is_refused_and_logged(peers, caplog) -> None:
    a, b = await peers("aaa", key="one"), await peers("bbb", key="two")
    with caplog.at_level(logging.WARNING):
        assert await a.net.dial("127.0.0.1", b.port) is None
        await asyncio.sleep(0.2)
    assert not a.net.links and not b.net.links
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any("cluster key mismatch" in m for m in refusals), refusals
    assert not b.received  # nothing was accepted from the impostor


async def test_simultaneous_dials_keep_one_link_on_both_sides(peers) -> None:
    a, b = await peers("aaa"), await peers("bbb")
    await asyncio.gather(a.net.dial("127.0.0.1", b.port), b.net.dial("127.0.0.1", a.port))
    await asyncio.sleep(0.3)
    assert a.net.linked("bbb") and b.net.linked("aaa")
    # Both kept the link dialed by the smaller id, so it is the same connection seen from both ends.
    assert a.net.links["bbb"].dialer_id == "aaa" == b.net.links["aaa"].dialer_id
    await a.net.send("bbb", {"type": "hello-again"})
    await wait_for(lambda: b.received)


async def test_dialing_yourself_makes_no_link_and_is_not_repeated(peers, monkeypatch) -> None:
    a = await peers("aaa")
    connections = []
    real_dial = a.net._dial

    async def counting_dial(*args):
        connections.append(args)
        return await real_dial(*args)

    monkeypatch.setattr(a.net, "_dial", counting_dial)
    assert await a.net.dial("127.0.0.1", a.port) is None
    assert await a.net.dial("127.0.0.1", a.port) is None  # the redial loop asks again every few seconds
    assert len(connections) == 1  # ... but a --peers list naming this node costs one handshake, not one per ask
    assert not a.net.links


async def test_oversized_frame_refused_by_sender(peers) -> None:
    a, b = await peers("aaa", max_frame=4096), await peers("bbb", max_frame=4096)
    await a.net.dial("127.0.0.1", b.port)
    with pytest.raises(FrameError, match="exceeds"):
        await a.net.send("bbb", {"type": "big", "data": b"x" * 5000})
    assert a.net.linked("bbb")


async def test_oversized_frame_refused_by_receiver(peers) -> None:
    a, b = await peers("aaa", max_frame=1 << 20), await peers("bbb", max_frame=4096)
    await a.net.dial("127.0.0.1", b.port)
    await wait_for(lambda: b.net.linked("aaa"))
    await a.net.links["bbb"].send({"type": "big", "data": b"x" * 8000})
    await wait_for(lambda: not b.net.linked("aaa") and not a.net.linked("bbb"))
    assert not b.received


async def test_lost_peer_noticed_and_reported(peers) -> None:
    a, b = await peers("aaa"), await peers("bbb")
    await a.net.dial("127.0.0.1", b.port)
    await wait_for(lambda: b.net.linked("aaa"))
    changes_before = a.changes
    await b.stop()
    await wait_for(lambda: not a.net.linked("bbb"), timeout=3.0)
    assert a.changes > changes_before
