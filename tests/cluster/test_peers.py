"""Peer links over real loopback sockets: authentication, refusal, duplicates, frame limits, invalid frames, loss,
and the reasons a node gives for peers it cannot link with."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import msgpack
import pytest
from aiohttp import web

from discovery import PeerAddress, PeerFinder
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.peers import CONNECT_TIMEOUT, PEER_PATH, PeerLink, PeerNetwork
from exo_like.cluster.protocol import (
    DEFAULT_MAX_FRAME_BYTES, PROTOCOL, Error, Hello, MemberAddress, Message, PeerAddresses, Ping, PlanState,
    ProtocolError, Refused, Release, Retire, decode, encode,
)
from tests.api_server import NodeProcess, checkpoint, start_node  # noqa: F401  (checkpoint: a fixture)
from tests.api_server import wait_for as node_wait_for
from tests.cluster_harness import free_ports, wait_until_ready


class Peer:
    """A PeerNetwork behind a real aiohttp server on 127.0.0.1, recording what it receives."""

    def __init__(self, node_id: str, key: str, max_frame: int = 1 << 20, dtype: str | None = None):
        self.received: list[tuple[str, Message]] = []
        self.learned: list[MemberAddress] = []  # where members of its peers listen (peer exchange)
        self.changes = 0
        self.info = NodeInfo(node_id, f"name-{node_id}", "127.0.0.1", 0, "torch", "cpu", "test", 1 << 30, "0", dtype)
        self.net = PeerNetwork(self.info, key, self._handle, self._changed, max_frame_bytes=max_frame,
                               on_addresses=self.learned.extend)
        self.port = 0

    async def _handle(self, link: PeerLink, message: Message) -> None:
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


HANG_SECONDS = 60.0  # only a guard against hanging: nothing asserted depends on how fast this machine is


async def wait_for(predicate, timeout: float = HANG_SECONDS) -> None:
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
    await a.net.send("bbb", Release("r1"))
    await b.net.send("aaa", Error("r2", "it broke \u2603", "stage_failed"))
    await wait_for(lambda: a.received and b.received)
    assert b.received == [("aaa", Release("r1"))]
    assert a.received == [("bbb", Error("r2", "it broke \u2603", "stage_failed"))]


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
    await a.net.send("bbb", Release("again"))
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
            await peer.net.send(to, Release(str(len(sent))))  # raises if the link is lost
            sent.append(len(sent))
            await asyncio.sleep(0)
    return asyncio.ensure_future(run())


def numbers_from(peer: Peer, sender: str) -> list[int]:
    return sorted(int(m.rid) for who, m in peer.received if who == sender and isinstance(m, Release))


async def test_a_duplicate_link_replaces_the_first_without_losing_a_frame(peers, monkeypatch) -> None:
    """b advertises an address other than the one a dials (bound to all interfaces, say), so a cannot tell it is
    already linked and a second link is made; it is dialed by the smaller id, so both sides switch to it while
    frames flow both ways. Every frame sent on either link arrives exactly once and the old link closes as soon as
    both sides have retired it: the grace period is an hour here, so a close seen at all did not wait it out."""
    import exo_like.cluster.peers as peers_module

    monkeypatch.setattr(peers_module, "RETIRE_GRACE_SECONDS", 3600.0)
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
    await wait_for(lambda: old.closed)  # both sides retired it: no waiting out the (hour's) grace period
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*streams)
    await wait_for(lambda: len(numbers_from(b, "aaa")) >= len(sent_by_a) and
                   len(numbers_from(a, "bbb")) >= len(sent_by_b))
    assert numbers_from(b, "aaa") == sent_by_a and numbers_from(a, "bbb") == sent_by_b
    assert len(sent_by_a) > 100 and len(sent_by_b) > 100
    assert not [m for _, m in a.received + b.received if isinstance(m, Retire)]  # link control, not a message


async def test_a_ping_answered_while_its_link_is_replaced_leaves_no_failed_task(peers, monkeypatch) -> None:
    """The Pong to a Ping waits for the link's turn to send; when a duplicate link replaces this one meanwhile, the
    Pong is dropped. It used to raise LinkRetired in a task nobody awaited ("Task exception was never retrieved"
    and a traceback in the node's log; seen on a loaded machine as three nodes linked)."""
    a, b = await peers("aaa"), await peers("bbb")
    link = await a.net.dial("127.0.0.1", b.port)
    assert link is not None
    spawned: list[asyncio.Task] = []  # the tasks the network starts, kept to ask how they ended
    monkeypatch.setattr(a.net, "_spawn", lambda coro: spawned.append(asyncio.ensure_future(coro)))
    async with link._send_lock:  # a frame being sent: the Pong waits for its turn
        a.net._answer_ping(link, Ping(time.monotonic()))
        pong = spawned[-1]
        await asyncio.sleep(0.05)
        link.retired = True  # replaced by a duplicate meanwhile (as PeerNetwork._retire marks it)
    await asyncio.wait([pong], timeout=HANG_SECONDS)
    assert pong.done() and pong.exception() is None


async def test_a_peer_that_does_not_retire_the_duplicate_is_cut_off_and_seen_lost(peers, monkeypatch) -> None:
    """If the other side goes on using the old link, frames it sends after the close would vanish without a trace:
    its current link is cut too, so both sides see the peer lost (failing requests through it) and relink."""
    import exo_like.cluster.peers as peers_module

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
    await wait_for(lambda: old.closed and not a.net.linked("bbb") and not b.net.linked("aaa"))
    # Each side's loss is told once its link's read loop has ended, which can come a moment after the link is
    # marked closed (on a loaded machine, after the check above passed).
    await wait_for(lambda: a.changes > changes[0] and b.changes > changes[1])


async def test_a_node_given_one_member_learns_where_the_others_listen_and_links_with_them(peers) -> None:
    a, b, c = await peers("aaa"), await peers("bbb"), await peers("ccc")
    assert await b.net.dial("127.0.0.1", a.port) is not None  # b dials: a sees it come from a port nobody listens on
    assert await c.net.dial("127.0.0.1", c.port) is None  # (itself: nothing to learn)
    assert await c.net.dial("127.0.0.1", a.port) is not None  # c was given a's address only
    await wait_for(lambda: c.learned and b.learned)
    # Each learns the other as it advertises itself, never itself nor the peer that told it.
    assert c.learned == [MemberAddress("bbb", "127.0.0.1", b.port)]
    assert b.learned == [MemberAddress("ccc", "127.0.0.1", c.port)]
    assert a.learned == []
    finder = PeerFinder("ccc", lambda host, port: _dial_id(c, host, port), c.net.linked, [], None)
    for member in c.learned:
        finder.found_by_peer(PeerAddress(member.host, member.port, member.node_id))
    await finder._dial_unlinked()  # one round of the redial loop
    await wait_for(lambda: c.net.linked("bbb") and b.net.linked("ccc"))
    await asyncio.sleep(0.1)
    assert c.learned == [MemberAddress("bbb", "127.0.0.1", b.port)]  # linked now: nothing more to learn


async def test_addresses_of_this_node_and_of_linked_peers_are_not_passed_on(peers) -> None:
    a, b = await peers("aaa"), await peers("bbb")
    link = await a.net.dial("127.0.0.1", b.port)
    assert link is not None
    await link.send(PeerAddresses((MemberAddress("bbb", "127.0.0.1", b.port), MemberAddress("aaa", "10.9.9.9", 1),
                                   MemberAddress("zzz", "127.0.0.1", 9))))
    await wait_for(lambda: b.learned)
    assert b.learned == [MemberAddress("zzz", "127.0.0.1", 9)]
    assert not any(isinstance(message, PeerAddresses) for _, message in b.received)  # the transport's own


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
    with pytest.raises(ProtocolError, match="exceeds"):
        await a.net.send("bbb", Error("r", "x" * 5000, "c"))
    assert a.net.linked("bbb")


# -- frames that are not valid messages ----------------------------------------------------------------------

def bad_frames(limit: int) -> list[tuple[str, bytes, str]]:
    """(what, frame, what its refusal says): one frame for each way a frame can fail to be a message, for a
    receiver whose protocol limit is `limit` (the oversized one stays under its websocket limit)."""
    return [
        ("malformed msgpack", b"\xc1\x00\xff", "undecodable frame"),
        ("unknown type", msgpack.packb({"type": "teleport", "to": "mars"}), "unknown message type 'teleport'"),
        ("truncated", encode(Error("r", "boom", "stage_failed"))[:-2], "undecodable frame"),
        ("oversized", msgpack.packb({"type": "release", "rid": "x" * (limit + 100)}), f"{limit}-byte limit"),
        ("semantically invalid", msgpack.packb({"type": "release", "rid": 7}), "invalid release: field 'rid'"),
    ]


def more_bad_frames() -> list[tuple[str, bytes, str]]:
    plan_state = {"type": "plan_state", "wishes": [], "instances": [], "figures": [], "linked": []}
    forward = {"type": "forward", "digest": "d", "kv_used": 0,
               "items": [{"rid": "r", "origin": "o", "start": 0, "count": 2, "blocks": [0]}],
               "hidden": {"dtype": "float32", "shape": [1, 4], "data": b"\0" * 16}}
    return [
        ("not a map", msgpack.packb([1, 2]), "a frame must be a map"),
        ("missing field", msgpack.packb({"type": "error", "rid": "r", "code": "c"}), "missing field 'message'"),
        ("ill-typed load", msgpack.packb({**plan_state, "load": {"in_flight": "many"}}), "field 'in_flight'"),
        ("rows and items disagree", msgpack.packb(forward), "does not hold the items' 2 rows"),
        ("link set-up after set-up", encode(Hello(b"n" * 16, PROTOCOL, "0")), "a hello frame on a link already"),
    ]


def refusals(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and "refused a frame" in r.getMessage()]


def assert_no_errors(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.parametrize("sender", ["dialer", "acceptor"])
async def test_invalid_frames_are_refused_one_warning_each_and_the_link_goes_on(peers, caplog, monkeypatch,
                                                                               sender) -> None:
    import exo_like.cluster.peers as peers_module

    monkeypatch.setattr(peers_module, "REFUSALS_LOGGED_PER_LINK", 100)  # every refusal as a warning, to count
    a, b = await peers("aaa", max_frame=1 << 20), await peers("bbb", max_frame=4096)
    (a, b) = (a, b) if sender == "dialer" else (b, a)  # b receives, over the link a dialed (or accepted)
    dialer, acceptor = (a, b) if sender == "dialer" else (b, a)
    assert await dialer.net.dial("127.0.0.1", acceptor.port) is not None
    await wait_for(lambda: a.net.linked(b.info.node_id) and b.net.linked(a.info.node_id))
    link_at_a, link_at_b = a.net.links[b.info.node_id], b.net.links[a.info.node_id]
    cases = bad_frames(b.net.max_frame_bytes) + more_bad_frames()
    with caplog.at_level(logging.DEBUG):
        for _, frame, _ in cases:
            await link_at_a.ws.send_bytes(frame)
        await link_at_a.ws.send_str("not a frame")
        await wait_for(lambda: len(refusals(caplog)) == len(cases) + 1)
        await a.net.send(b.info.node_id, Release("after"))
        await wait_for(lambda: b.received)
    warnings = refusals(caplog)
    for (what, _, says), warning in zip(cases, warnings):
        assert warning.startswith(f"node {b.info.node_id}: refused a frame from {a.info.node_id} at "), warning
        assert says in warning, (what, warning)
        assert "\n" not in warning
    assert "a text frame" in warnings[-1]
    assert len(warnings) == len(cases) + 1  # one line per frame
    assert_no_errors(caplog)
    assert b.received == [(a.info.node_id, Release("after"))]  # nothing invalid reached the handler
    assert a.net.links[b.info.node_id] is link_at_a and b.net.links[a.info.node_id] is link_at_b
    assert not link_at_a.closed and not link_at_b.closed and link_at_b.refused_frames == len(cases) + 1


async def test_a_peer_sending_only_invalid_frames_does_not_flood_the_log(peers, caplog) -> None:
    import exo_like.cluster.peers as peers_module

    a, b = await peers("aaa"), await peers("bbb")
    await a.net.dial("127.0.0.1", b.port)
    await wait_for(lambda: b.net.linked("aaa"))
    sent = peers_module.REFUSALS_LOGGED_PER_LINK + 20
    with caplog.at_level(logging.DEBUG):
        for n in range(sent):
            await a.net.links["bbb"].ws.send_bytes(msgpack.packb({"type": "teleport", "n": n}))
        await wait_for(lambda: len(refusals(caplog, logging.DEBUG)) == 20)
        await a.net.send("bbb", Release("after"))
        await wait_for(lambda: b.received)
        await a.net.links["bbb"].close()
        await wait_for(lambda: not b.net.linked("aaa"))
    warnings = refusals(caplog)
    assert len(warnings) == peers_module.REFUSALS_LOGGED_PER_LINK
    assert warnings[-1].endswith("(further refused frames on this link are logged at debug level)")
    assert not any("debug level" in w for w in warnings[:-1])
    lost = [r.getMessage() for r in caplog.records if "lost link with aaa" in r.getMessage()]
    assert lost and lost[0].endswith(f"{sent} frames from it refused"), lost


async def test_a_frame_past_the_websocket_limit_closes_the_link_says_why_and_the_peers_relink(peers, caplog) -> None:
    """Past the websocket's own limit aiohttp does not read the frame: it closes the link. Both sides say why,
    and the finder links them again (a node's finder redials every peer it is not linked with)."""
    from exo_like.cluster.peers import websocket_limit

    a, b = await peers("aaa", max_frame=1 << 20), await peers("bbb", max_frame=4096)
    finder = PeerFinder("aaa", lambda host, port: _dial_id(a, host, port), a.net.linked,
                        [PeerAddress("127.0.0.1", b.port)], None)
    await finder.start()
    try:
        await wait_for(lambda: a.net.linked("bbb") and b.net.linked("aaa"))
        first = a.net.links["bbb"]
        with caplog.at_level(logging.INFO):
            await first.ws.send_bytes(msgpack.packb({"type": "release", "rid": "x" * websocket_limit(4096)}))
            await wait_for(lambda: first.closed)
            await wait_for(lambda: a.net.linked("bbb") and b.net.linked("aaa"))  # at the finder's next redial
        await a.net.send("bbb", Release("after"))
        await wait_for(lambda: b.received)
    finally:
        await finder.stop()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("node bbb: closing the link with aaa at 127.0.0.1: it sent a frame past this node's "
                            f"{websocket_limit(4096)}-byte websocket limit") for m in messages), messages
    assert any(m.startswith("node aaa: lost link with bbb: it closed the link because a frame from this node was "
                            "past its websocket size limit") for m in messages), messages
    assert_no_errors(caplog)
    assert a.net.links["bbb"] is not first and b.received == [("aaa", Release("after"))]


async def _dial_id(peer: Peer, host: str, port: int) -> str | None:
    link = await peer.net.dial(host, port)
    return link.remote.node_id if link else None


async def test_lost_peer_noticed_and_reported(peers) -> None:
    a, b = await peers("aaa"), await peers("bbb")
    await a.net.dial("127.0.0.1", b.port)
    await wait_for(lambda: b.net.linked("aaa"))
    changes_before = a.changes
    await b.stop()
    await wait_for(lambda: not a.net.linked("bbb"))
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
            hello = decode((await ws.receive(timeout=5)).data)
            assert isinstance(hello, Hello) and hello.protocol == PROTOCOL
            # The handshake of a version before protocol numbers: it ignores the hello's number and sends none.
            await ws.send_bytes(msgpack.packb({"type": "auth", "nonce": b"n" * 16, "proof": b"p" * 32}))
            answer = decode((await ws.receive(timeout=5)).data)
    assert isinstance(answer, Refused) and answer.reason.startswith("different exo-like versions")
    assert answer.protocol == PROTOCOL
    problem = problems_of(b)["127.0.0.1"]
    assert problem["code"] == "version_mismatch" and "it speaks no peer protocol number" in problem["reason"]
    assert not b.net.links


async def test_an_acceptor_too_old_to_send_a_protocol_is_not_linked(peers) -> None:
    async def old_acceptor(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(msgpack.packb({"type": "hello", "nonce": b"n" * 16}))
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
        # It gives up by itself (None, not the hang guard's TimeoutError) ...
        assert await asyncio.wait_for(a.net.dial("127.0.0.1", port), HANG_SECONDS) is None
        waited = time.monotonic() - started
    # ... once its connect timeout has run out (not measured against a clock a busy machine stretches: the dial
    # waited at least that long, and the connect timeout is what bounds its wait).
    assert waited >= CONNECT_TIMEOUT - 1e-3 and a.net._session.timeout.sock_connect == CONNECT_TIMEOUT
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
    """The dial of an address that drops packets gives up after its connect timeout, so the finder's next round
    links the peer that started meanwhile: counted in rounds (dials of the dead address), not in seconds."""
    a = await peers("aaa")
    dead_dials = 0

    async def dial(host: str, port: int) -> str | None:
        nonlocal dead_dials
        dead_dials += port == dead_port
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
            rounds_before = dead_dials  # each round dials the dead address once, beside the late one
            await wait_for(lambda: a.net.linked("bbb"))
            # Linked in the first round begun since bbb listens: that round's dead dial did not hold it up.
            assert dead_dials <= rounds_before + 1, (rounds_before, dead_dials)
        finally:
            await finder.stop()
    assert problems_of(a)[f"127.0.0.1:{dead_port}"]["code"] == "unreachable"


# -- a running node --------------------------------------------------------------------------------------------

async def test_a_running_node_refuses_invalid_frames_and_goes_on_serving(checkpoint, tmp_path) -> None:  # noqa: F811
    """The same frames, sent to a real `exo-like` process over a link authenticated with its cluster key: it
    refuses each with one warning and no traceback, keeps the link (a valid announcement sent after them
    arrives), and serves requests as before."""
    key = "invalid-frames-test-key"
    node = await asyncio.to_thread(start_node, tmp_path / "home", str(checkpoint), "--no-mdns", "--cluster-key", key,
                                   "--dtype", "float32")
    received: list[Message] = []

    async def keep(link: PeerLink, message: Message) -> None:
        received.append(message)

    me = NodeInfo("frame-tester", "tester", "127.0.0.1", 9, "torch", "cpu", "test", 1 << 20, "0")
    net = PeerNetwork(me, key, keep, lambda: None)
    try:
        link = await net.dial("127.0.0.1", node.port)
        assert link is not None
        cases = bad_frames(DEFAULT_MAX_FRAME_BYTES)
        try:
            for _, frame, _ in cases:
                await link.ws.send_bytes(frame)
            await link.send(PlanState((), (), NodeLoad(tokens_per_second=12.5).to_json()))
        except ConnectionError as exc:  # the link closed under the frames: say why, as the node saw it
            pytest.fail(f"the link closed ({exc}; close code {link.ws.close_code}); the node's log ends:\n"
                        f"{node.log()[-4000:]}")
        assert await asyncio.to_thread(node_wait_for, lambda: _announced_rate(node, "frame-tester") == 12.5)
        assert net.linked(link.remote.node_id) and not link.closed  # the same link all along
        refused = [line for line in node.log().splitlines() if "refused a frame from frame-tester" in line]
        assert len(refused) == len(cases), refused
        for (what, _, says), line in zip(cases, refused):
            assert " WARNING " in line and f"node {link.remote.node_id}: refused a frame" in line, line
            assert says in line, (what, line)
        assert any(isinstance(m, PlanState) for m in received)  # and the node's announcements still come
    finally:
        await net.close()
    try:
        await asyncio.to_thread(wait_until_ready, [node], 1)
        assert (await asyncio.to_thread(node.get_json, "/health"))["status"] == "ok"
        body = json.dumps({"model": str(checkpoint), "messages": [{"role": "user", "content": "Hello!"}],
                           "max_tokens": 4}).encode()
        status, _, answer = await asyncio.to_thread(node.request, "POST", "/v1/chat/completions", body,
                                                    {"Content-Type": "application/json"})
        assert status == 200, answer
        assert json.loads(answer)["choices"][0]["message"]["content"] is not None
    finally:
        assert node.stop() == 0, node.log()
    assert "Traceback" not in node.log() and " ERROR " not in node.log(), node.log()


def _announced_rate(node: NodeProcess, node_id: str) -> float | None:
    members = {member["id"]: member for member in node.get_json("/v1/cluster")["nodes"]}
    return members[node_id]["tokens_per_second"] if node_id in members else None


async def test_links_measure_their_round_trip_and_bandwidth(peers, monkeypatch) -> None:
    """Every few Pings one carries padding: its round trip beyond a plain one gives the link's bytes per second."""
    import exo_like.cluster.peers as peers_module

    monkeypatch.setattr(peers_module, "PING_SECONDS", 0.01)
    monkeypatch.setattr(peers_module, "BULK_PING_EVERY", 2)
    a, b = await peers("aaa"), await peers("bbb")
    assert await a.net.dial("127.0.0.1", b.port) is not None
    await wait_for(lambda: "bbb" in a.net.bandwidths() and a.net.lowest_round_trips(3).get("bbb") is not None)
    link = a.net.links["bbb"]
    assert link.min_bulk_rtt > link.min_rtt  # the padded frame took longer than a plain one
    assert a.net.bandwidths()["bbb"] == peers_module.BULK_PING_BYTES / (link.min_bulk_rtt - link.min_rtt)
    assert not [m for _, m in a.received + b.received if isinstance(m, Ping)]  # link control, not a message
