"""Peer links over real loopback sockets: authentication, refusal, duplicates, frame limits, loss, and the
reasons a node gives for peers it cannot link with."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from discovery import PeerAddress, PeerFinder
from discovery.finder import REDIAL_SECONDS
from exo_like.node_info import NodeInfo
from exo_like.peers import CONNECT_TIMEOUT, PEER_PATH, PeerLink, PeerNetwork
from exo_like.wire import PROTOCOL, FrameError, decode_frame, encode_frame
from tests.cluster_harness import free_ports


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

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        self.net.add_routes(app)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.info = self.net.me = dataclasses.replace(self.info, port=self.port)  # advertised, as a node does

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

    async def make(node_id: str, key: str = "secret", port: int = 0, **kwargs) -> Peer:
        peer = Peer(node_id, key, **kwargs)
        await peer.start(port)
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
    # Both sides list the other with the reason, for GET /v1/cluster and the dashboard.
    seen_by_dialer, seen_by_acceptor = problems_of(a)[f"127.0.0.1:{b.port}"], problems_of(b)["127.0.0.1"]
    assert seen_by_dialer["code"] == seen_by_acceptor["code"] == "key_mismatch"
    assert "different cluster key" in seen_by_dialer["reason"] and "--cluster-key" in seen_by_dialer["reason"]
    assert seen_by_acceptor["reason"].startswith("it dialed this node and was refused: cluster key mismatch")


async def test_simultaneous_dials_keep_one_link_on_both_sides(peers) -> None:
    a, b = await peers("aaa"), await peers("bbb")
    await asyncio.gather(a.net.dial("127.0.0.1", b.port), b.net.dial("127.0.0.1", a.port))
    await asyncio.sleep(0.3)
    assert a.net.linked("bbb") and b.net.linked("aaa")
    # Both kept the link dialed by the smaller id, so it is the same connection seen from both ends.
    assert a.net.links["bbb"].dialer_id == "aaa" == b.net.links["aaa"].dialer_id
    await a.net.send("bbb", {"type": "hello-again"})
    await wait_for(lambda: b.received)


async def test_dialing_a_peer_that_already_dialed_in_keeps_the_link_it_made(peers) -> None:
    """Nodes started one after another: the later one dials in first, then the earlier one's redial round reaches
    the later one's --peers address. A second link would replace the first under requests already using it."""
    a, b = await peers("aaa"), await peers("bbb")
    assert await b.net.dial("127.0.0.1", a.port) is not None
    await wait_for(lambda: a.net.linked("bbb"))
    first = a.net.links["bbb"]
    assert await a.net.dial("127.0.0.1", b.port) is first
    await asyncio.sleep(0.3)
    assert a.net.links["bbb"] is first and not first.closed
    assert b.net.links["aaa"].dialer_id == "bbb"


def counted_stream(peer: Peer, to: str, sent: list[int], stop: asyncio.Event) -> Any:
    async def run() -> None:
        while not stop.is_set():
            await peer.net.send(to, {"type": "numbered", "n": len(sent)})  # raises if the link is lost
            sent.append(len(sent))
            await asyncio.sleep(0)
    return asyncio.ensure_future(run())


def numbers_from(peer: Peer, sender: str) -> list[int]:
    return sorted(m["n"] for who, m in peer.received if who == sender and m["type"] == "numbered")


async def test_a_duplicate_link_replaces_the_first_without_losing_a_frame(peers) -> None:
    """b advertises an address other than the one a dials (bound to all interfaces, say), so a cannot tell it is
    already linked and a second link is made; it is dialed by the smaller id, so both sides switch to it while
    frames flow both ways. Every frame sent on either link arrives exactly once and the old link closes."""
    a, b = await peers("aaa"), await peers("bbb")
    b.net.me = b.info = dataclasses.replace(b.info, host="192.0.2.7")  # advertised only: never contacted
    assert await b.net.dial("127.0.0.1", a.port) is not None
    await wait_for(lambda: a.net.linked("bbb"))
    old = a.net.links["bbb"]
    stop = asyncio.Event()
    sent_by_a: list[int] = []
    sent_by_b: list[int] = []
    streams = [counted_stream(a, "bbb", sent_by_a, stop), counted_stream(b, "aaa", sent_by_b, stop)]
    await asyncio.sleep(0.1)
    assert (await a.net.dial("127.0.0.1", b.port)) is not old
    await wait_for(lambda: a.net.links["bbb"].dialer_id == "aaa" == b.net.links["aaa"].dialer_id)
    await wait_for(lambda: old.closed, timeout=2.0)  # both sides retired it: no waiting out the grace period
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*streams)
    await wait_for(lambda: len(numbers_from(b, "aaa")) >= len(sent_by_a) and
                   len(numbers_from(a, "bbb")) >= len(sent_by_b))
    assert numbers_from(b, "aaa") == sent_by_a and numbers_from(a, "bbb") == sent_by_b
    assert len(sent_by_a) > 100 and len(sent_by_b) > 100
    assert not [m for _, m in a.received + b.received if m["type"] == "retire"]  # link control, not a message


async def test_a_peer_that_does_not_retire_the_duplicate_is_cut_off_and_seen_lost(peers, monkeypatch) -> None:
    """If the other side goes on using the old link, frames it sends after the close would vanish without a trace:
    its current link is cut too, so both sides see the peer lost (failing requests through it) and relink."""
    import exo_like.peers as peers_module

    monkeypatch.setattr(peers_module, "RETIRE_GRACE_SECONDS", 0.5)
    a, b = await peers("aaa"), await peers("bbb")
    monkeypatch.setattr(b.net, "_retire", lambda link: None)  # b keeps its old link open and never says retire
    b.net.me = b.info = dataclasses.replace(b.info, host="192.0.2.7")
    assert await b.net.dial("127.0.0.1", a.port) is not None
    await wait_for(lambda: a.net.linked("bbb"))
    old = a.net.links["bbb"]
    new = await a.net.dial("127.0.0.1", b.port)
    assert new is not None and new is not old
    changes = a.changes, b.changes
    await wait_for(lambda: old.closed and not a.net.linked("bbb") and not b.net.linked("aaa"), timeout=3.0)
    assert a.changes > changes[0] and b.changes > changes[1]


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


# -- peers this node cannot link with ------------------------------------------------------------------------

def problems_of(peer: Peer) -> dict[str, dict[str, Any]]:
    return {problem["address"]: problem for problem in peer.net.problems.to_json()}


@contextmanager
def black_hole() -> Iterator[int]:
    """A loopback port whose new connections go unanswered, like an address behind a firewall that drops packets:
    a listener that never accepts, with its one-connection queue already full."""
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.1)
        yield port
    finally:
        for sock in [*fillers, listener]:
            sock.close()


@pytest.mark.parametrize("newer", ["dialer", "acceptor"])
async def test_nodes_of_different_protocols_refuse_each_other_and_both_name_the_versions(peers, newer) -> None:
    a, b = await peers("aaa"), await peers("bbb")
    (a if newer == "dialer" else b).net.protocol = PROTOCOL + 1
    assert await a.net.dial("127.0.0.1", b.port) is None
    await wait_for(lambda: b.net.problems.to_json())
    assert not a.net.links and not b.net.links and not b.received
    seen_by_dialer, seen_by_acceptor = problems_of(a)[f"127.0.0.1:{b.port}"], problems_of(b)["127.0.0.1"]
    for problem, mine, theirs in ((seen_by_dialer, a.net.protocol, b.net.protocol),
                                  (seen_by_acceptor, b.net.protocol, a.net.protocol)):
        assert problem["code"] == "version_mismatch", problem
        assert f"it speaks peer protocol {theirs} (exo-like " in problem["reason"], problem
        assert f"this node peer protocol {mine} (exo-like " in problem["reason"], problem
        assert "run the same exo-like version on every node" in problem["reason"]


async def test_a_dialer_too_old_to_check_protocols_is_told_why_it_is_refused(peers) -> None:
    b = await peers("bbb")
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"http://127.0.0.1:{b.port}{PEER_PATH}") as ws:
            hello = decode_frame((await ws.receive(timeout=5)).data)
            assert hello["protocol"] == PROTOCOL
            # The handshake of a version before protocol numbers: it ignores the hello's number and sends none.
            await ws.send_bytes(encode_frame({"type": "auth", "nonce": b"n" * 16, "proof": b"p" * 32}))
            answer = decode_frame((await ws.receive(timeout=5)).data)
    assert answer["type"] == "refused" and answer["reason"].startswith("different exo-like versions")
    problem = problems_of(b)["127.0.0.1"]
    assert problem["code"] == "version_mismatch" and "it speaks no peer protocol number" in problem["reason"]
    assert not b.net.links


async def test_an_acceptor_too_old_to_send_a_protocol_is_not_linked(peers) -> None:
    async def old_acceptor(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(encode_frame({"type": "hello", "nonce": b"n" * 16}))
        await ws.receive(timeout=5)
        return ws

    app = web.Application()
    app.router.add_get(PEER_PATH, old_acceptor)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        a = await peers("aaa")
        assert await a.net.dial("127.0.0.1", port) is None
    finally:
        await runner.cleanup()
    problem = problems_of(a)[f"127.0.0.1:{port}"]
    assert problem["code"] == "version_mismatch" and "it speaks no peer protocol number" in problem["reason"]


async def test_an_address_nobody_listens_on_is_listed_once_and_logged_once(peers, caplog) -> None:
    a = await peers("aaa")
    closed_port = free_ports(1)[0]
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):  # the finder redials every few seconds
            assert await a.net.dial("127.0.0.1", closed_port) is None
    problem = problems_of(a)[f"127.0.0.1:{closed_port}"]
    assert problem["code"] == "unreachable" and "cannot connect (Connection refused)" in problem["reason"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "not linked with" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert len(a.net.problems.to_json()) == 1


async def test_a_dial_to_an_address_that_drops_packets_gives_up_and_says_so(peers) -> None:
    a = await peers("aaa")
    with black_hole() as port:
        started = time.monotonic()
        assert await a.net.dial("127.0.0.1", port) is None
        waited = time.monotonic() - started
    assert waited < CONNECT_TIMEOUT + 2
    problem = problems_of(a)[f"127.0.0.1:{port}"]
    assert problem["code"] == "unreachable" and problem["reason"].startswith("no answer in time"), problem


async def test_problems_are_cleared_on_both_sides_once_the_peers_link(peers) -> None:
    a, b = await peers("aaa"), await peers("bbb")
    b.net.protocol = PROTOCOL + 1  # say, b was upgraded first ...
    assert await a.net.dial("127.0.0.1", b.port) is None
    await wait_for(lambda: a.net.problems.to_json() and b.net.problems.to_json())
    b.net.protocol = PROTOCOL  # ... and then a too
    assert await a.net.dial("127.0.0.1", b.port) is not None
    await wait_for(lambda: b.net.linked("aaa"))
    assert a.net.problems.to_json() == [] and b.net.problems.to_json() == []


async def test_a_failed_dial_is_cleared_when_that_peer_dials_in(peers) -> None:
    """Nodes started one after another: the first one's dial of a later one fails, then the later one links
    with it from its side. The first must not go on listing a linked peer as unreachable."""
    a = await peers("aaa")
    late_port = free_ports(1)[0]
    assert await a.net.dial("127.0.0.1", late_port) is None  # nothing there yet
    assert problems_of(a)[f"127.0.0.1:{late_port}"]["code"] == "unreachable"
    b = await peers("bbb", port=late_port)
    assert await b.net.dial("127.0.0.1", a.port) is not None
    await wait_for(lambda: a.net.linked("bbb"))
    assert a.net.problems.to_json() == []


async def test_a_peer_that_drops_packets_does_not_hold_up_linking_the_others(peers) -> None:
    a = await peers("aaa")

    async def dial(host: str, port: int) -> str | None:
        link = await a.net.dial(host, port)
        return link.remote.node_id if link else None

    late_port = free_ports(1)[0]
    with black_hole() as dead_port:
        finder = PeerFinder("aaa", dial, a.net.linked, [PeerAddress("127.0.0.1", dead_port),
                                                        PeerAddress("127.0.0.1", late_port)], None)
        await finder.start()
        try:
            await asyncio.sleep(0.5)  # the first round is under way: one dial refused, the other unanswered
            await peers("bbb", port=late_port)  # a peer that starts a little later
            await wait_for(lambda: a.net.linked("bbb"), timeout=CONNECT_TIMEOUT + REDIAL_SECONDS + 3)
        finally:
            await finder.stop()
    assert problems_of(a)[f"127.0.0.1:{dead_port}"]["code"] == "unreachable"
