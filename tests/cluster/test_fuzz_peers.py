"""Generated peer frames on an authenticated link to a real node: msgpack values of every shape, maps of every
message type with random fields, and a valid frame of every message type with one field corrupted.

The rules are those of tests/cluster/test_peers.py: a frame that is no valid message is refused with a log line and the
link goes on. Here every such frame must be refused exactly once (the node logs at debug level, so all refusals
are counted), none may raise a traceback, the link stays up and is read to the end, and afterwards the node
serves requests and links with peers as before. Frames that do decode (a Ping, a Release of an unknown request,
a Submit with the node's own plan digest) are handled like any peer's. EXO_LIKE_FUZZ_EXAMPLES runs more examples.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_like.engines.activations import Activations
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from partitioning.speed_figures import SpeedFigures
from exo_like.cluster.peers import PeerLink, PeerNetwork
from exo_like.cluster.protocol import (
    InstanceState,
    Wish,
    _TYPES, PROTOCOL, Auth, Error, Forward, Hello, Info, MemberAddress, Message, PeerAddresses, Ping, PlanState,
    Pong, ProtocolError, Refused, Release, Retire, Sampled, SampledToken, Submit, Tokens, Welcome, decode, encode,
)
from exo_like.engines.work import SampleSpec, SamplingParams, WorkItem
from tests.api_server import NodeProcess, checkpoint, start_node, wait_for  # noqa: F401  (checkpoint: a fixture)
from tests.cluster_harness import wait_until_ready

EXAMPLES = int(os.environ.get("EXO_LIKE_FUZZ_EXAMPLES", "1000"))
KEY = "peer-fuzz-key"
NOBODY = ("127.0.0.1", 9)  # where the members of valid PeerAddresses frames are said to listen: a closed port
FUZZER = "peer-fuzzer"
# Both ends wait an hour for a silent peer: what is tested is how frames are refused, and on a busy host a stall
# of either process past the default 1.5 s closed the link in the middle of the run (a loss rightly seen).
PEER_TIMEOUT = 3600.0
T = TypeVar("T")


class LinkThread:
    """A PeerNetwork on its own event loop thread, so hypothesis (synchronous) drives what it sends."""

    def __init__(self, node_id: str, memory_bytes: int = 1 << 20):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.received: list[Message] = []
        me = NodeInfo(node_id, "fuzzer", "127.0.0.1", 9, "torch", "cpu", "test", memory_bytes, "0")
        self.net = self.run(self._network(me))
        self.link: PeerLink | None = None

    async def _network(self, me: NodeInfo) -> PeerNetwork:
        return PeerNetwork(me, KEY, self._keep, lambda: None, peer_timeout=PEER_TIMEOUT)

    async def _keep(self, link: PeerLink, message: Message) -> None:
        self.received.append(message)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def dial(self, port: int) -> PeerLink:
        self.link = self.run(self.net.dial("127.0.0.1", port))
        assert self.link is not None
        return self.link

    def send_raw(self, frame: bytes) -> None:
        assert self.link is not None
        self.run(self.link.ws.send_bytes(frame))

    def close(self) -> None:
        self.run(self.net.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def peer_node(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:  # noqa: F811
    # Debug level: every refused frame is logged (past the first few, at debug), so each can be counted.
    node = start_node(tmp_path_factory.mktemp("peer-fuzz"), str(checkpoint), "--no-mdns", "--cluster-key", KEY,
                      "--dtype", "float32", "--log-level", "DEBUG", "--peer-timeout", str(PEER_TIMEOUT),
                      env={"HF_HUB_OFFLINE": "1"})
    yield node
    assert node.stop() == 0, node.log()
    assert "Traceback" not in node.log() and " ERROR " not in node.log(), node.log()


# -- generated frames --------------------------------------------------------------------------------------------
# Strategies drawn from inside others are made once (functools.cache): a strategy checks itself once, and making
# the recursive one anew for every frame cost more than sending it. The frames drawn are the same.

@functools.cache
def msgpack_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                        st.text(max_size=20), st.binary(max_size=20),
                        st.sampled_from([2**63, 2**63 - 1, 2**64 - 1, -(2**63), 2**31, -1, 0.0, -0.0, 1e308]),
                        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)))
    keys = st.one_of(st.text(max_size=10), st.sampled_from(FIELD_NAMES))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(keys, inner, max_size=4)),
                        max_leaves=12)


def prototypes(digest: str, hidden: int = 8) -> dict[str, Message]:
    """A valid message of every type, on this node's plan digest where it takes one."""
    sample = SampleSpec(SamplingParams(0.0, seed=1), 4, (0,), 3)
    item = WorkItem("r1", FUZZER, 0, 1, (0,), sample)
    return {message.type: message for message in [
        Hello(b"n" * 16, PROTOCOL, "0"), Auth(b"n" * 16, PROTOCOL, "0", b"p" * 32),
        Welcome(_info(), b"p" * 32), Info(_info()), Refused("why"), Retire(), Ping(1.0), Pong(1.0),
        PlanState((), (InstanceState("m", digest),), NodeLoad().to_json()),
        Submit("r1", FUZZER, digest, (1, 2, 3), sample),
        Forward(digest, (item,), Activations("float32", (1, hidden), bytes(4 * hidden))),
        Sampled(digest, (SampledToken("r1", 5, False),)), Tokens(digest, (SampledToken("r1", 5, True),)),
        Release("r1"), Error("r1", "it broke", "stage_failed"),
        PeerAddresses((MemberAddress("fuzz-other", NOBODY[0], NOBODY[1]),)),
    ]}


def _info() -> dict[str, Any]:
    return NodeInfo(FUZZER, "fuzzer", "127.0.0.1", 9, "torch", "cpu", "test", 1 << 20, "0").to_dict()


def _paths(wire: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a frame's value a field can be corrupted: map keys and list indexes, nested."""
    places: list[tuple[Any, ...]] = []
    children = wire.items() if isinstance(wire, dict) else enumerate(wire) if isinstance(wire, list) else []
    for key, value in children:
        places.append(prefix + (key,))
        places.extend(_paths(value, prefix + (key,)))
    return places


FIELD_NAMES = sorted({str(path[-1]) for message in prototypes("d").values()
                      for path in _paths(message.to_wire()) if isinstance(path[-1], str)})


@st.composite
def corrupted(draw: st.DrawFn, digest: str, hidden: int) -> bytes:
    """A valid frame of some type with one field (at any depth) replaced by a generated value, or removed."""
    message = draw(st.sampled_from(sorted(prototypes(digest, hidden).values(), key=lambda m: m.type)))
    wire = {"type": message.type, **message.to_wire()}
    places = _paths(message.to_wire())
    if not places:
        return msgpack.packb({**wire, draw(st.sampled_from(FIELD_NAMES)): draw(msgpack_values())})
    place = draw(st.sampled_from(places))
    parent = wire
    for key in place[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[place[-1]]
    else:
        parent[place[-1]] = draw(msgpack_values())
    return msgpack.packb(wire)


@st.composite
def typed_maps(draw: st.DrawFn) -> bytes:
    """A map of a known type with generated fields (known names or not, values of any shape)."""
    fields = draw(typed_fields())
    return msgpack.packb({**fields, "type": draw(st.sampled_from(sorted(_TYPES)))})


@functools.cache
def typed_fields() -> st.SearchStrategy[dict[Any, Any]]:
    return st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8)), msgpack_values(),
                           max_size=6)


def valid_messages(digest: str, hidden: int) -> st.SearchStrategy[Message]:
    """Messages that decode, with generated values in their fields' ranges: what the node's handlers get."""
    rid = st.one_of(st.just("r1"), st.text(max_size=8))
    digests = st.one_of(st.just(digest), st.text(max_size=16))
    token = st.one_of(st.integers(0, 100), st.integers(0, 2**31 - 1))
    big = st.one_of(st.integers(1, 8), st.integers(1, 2**63 - 1))
    penalty = st.one_of(st.just(0.0), st.floats(-2, 2))
    params = st.builds(SamplingParams, st.floats(0, 1e6), st.floats(0, 1), st.integers(0, 2**63 - 1),
                       st.integers(0, 2**63 - 1), st.floats(0, 1), penalty, penalty,
                       st.one_of(st.just(1.0), st.floats(0.5, 2)),
                       st.lists(st.tuples(token, st.floats(-100, 100)), max_size=3).map(tuple),
                       st.none() | st.integers(0, 20), st.none() | st.text(max_size=40))
    history = st.none() | st.lists(token, min_size=8, max_size=12).map(tuple)
    sample = st.builds(SampleSpec, params, big, st.lists(token, max_size=3).map(tuple), st.integers(1, 8), history)
    item = st.builds(WorkItem, rid, st.just(FUZZER), st.integers(0, 2**40), st.integers(1, 3),
                     st.lists(st.integers(0, 2**63 - 1), max_size=3).map(tuple), st.none() | sample)
    forward = st.lists(item, min_size=1, max_size=3).map(
        lambda items: (items, sum(i.count for i in items))).flatmap(
        lambda ir: st.builds(Forward, digests, st.just(tuple(ir[0])),
                             st.just(Activations("float32", (ir[1], hidden), bytes(4 * hidden * ir[1]))),
                             st.integers(0, 2**63 - 1)))
    logprob = st.floats(-50, 0)
    sampled = st.lists(st.one_of(
        st.builds(SampledToken, rid, token, st.booleans()),
        st.builds(SampledToken, rid, token, st.booleans(), logprob,
                  st.lists(st.tuples(token, logprob), max_size=3).map(tuple))), max_size=3).map(tuple)
    return st.one_of(
        st.builds(Submit, rid, st.just(FUZZER), digests, st.lists(token, min_size=1, max_size=8).map(tuple), sample),
        forward, st.builds(Sampled, digests, sampled), st.builds(Tokens, digests, sampled),
        st.builds(Release, rid), st.builds(Error, rid, st.text(max_size=20), st.text(max_size=10)),
        st.builds(Ping, st.floats(0, 1e12)), st.builds(Pong, st.floats(0, 1e12)),
        st.builds(PlanState,
                  st.lists(st.builds(Wish, st.text(max_size=8), st.tuples(st.integers(0, 2**63 - 1),
                                                                           st.text(max_size=8)), st.booleans()),
                           max_size=2).map(tuple),
                  st.lists(st.builds(InstanceState, st.text(max_size=8), digests | st.none(), st.booleans(),
                                     st.none() | st.text(max_size=20), st.none() | st.integers(0, 2**63 - 1)),
                           max_size=2).map(tuple),
                  st.just(NodeLoad().to_json())))


def frames(digest: str, hidden: int) -> st.SearchStrategy[bytes]:
    anything = msgpack_values().map(msgpack.packb)
    truncated = corrupted(digest, hidden).flatmap(
        lambda frame: st.integers(0, len(frame) - 1).map(lambda n: frame[:n]))
    return st.one_of(corrupted(digest, hidden), valid_messages(digest, hidden).map(encode), typed_maps(), anything,
                     st.binary(max_size=64), truncated)


def harmless(frame: bytes, model: str) -> bytes:
    """A frame as sent. The one valid frame that would change the node for good is a PlanState whose instance
    registers ask for other models or unload the served one: the cluster rightly follows them. Such an announcement
    asks for nothing. A valid PeerAddresses makes the node dial the members it names: they are all said to listen
    at NOBODY."""
    try:
        message = decode(frame)
    except ProtocolError:
        return frame
    if isinstance(message, PlanState) and message.wishes:
        return encode(dataclasses.replace(message, wishes=()))
    if isinstance(message, PeerAddresses):  # the node dials what it names: only ever a closed port on loopback
        return encode(PeerAddresses(tuple(dataclasses.replace(m, host=NOBODY[0], port=NOBODY[1])
                                          for m in message.members)))
    return frame


def refused(frame: bytes) -> bool:
    """Whether the node must refuse the frame: it is no message, or a link set-up message on a link set up."""
    try:
        return isinstance(decode(frame), (Hello, Auth, Welcome, Info, Refused))
    except ProtocolError:
        return True


# -- the run -----------------------------------------------------------------------------------------------------

def refusals(node: NodeProcess) -> int:  # noqa: F811
    return sum(f"refused a frame from {FUZZER} " in line for line in node.log().splitlines())


def stage_digest(node: NodeProcess, node_id: str) -> str | None:  # noqa: F811
    """The node's plan digest once its plan gives `node_id` layers."""
    plan = node.get_json("/v1/cluster").get("plan") or {}
    return plan.get("digest") if any(s["node_id"] == node_id for s in plan.get("stages", [])) else None


def cluster_member(node: NodeProcess, node_id: str) -> dict[str, Any] | None:  # noqa: F811
    members = {member["id"]: member for member in node.get_json("/v1/cluster")["nodes"]}
    return members.get(node_id)


def test_every_message_type_has_a_prototype() -> None:
    assert set(prototypes("d")) == set(_TYPES)  # a message type added later is corrupted too


# The ring orders nodes by memory: with less the fuzzer is the last stage (the node schedules and runs the first
# layers of Submits), with more the first (the node runs Forwards through the last layers and samples).
@pytest.mark.parametrize("fuzzer_memory", [1 << 20, 1 << 50], ids=["node-first", "node-last"])
def test_generated_frames_are_refused_and_the_node_goes_on(peer_node: NodeProcess, checkpoint: Path,  # noqa: F811
                                                           fuzzer_memory: int) -> None:
    node = peer_node
    model = node.get_json("/v1/cluster")["model"]
    hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    fuzzer = LinkThread(FUZZER, fuzzer_memory)
    before = refusals(node)
    sent = {"frames": 0, "refused": 0}
    try:
        link = fuzzer.dial(node.port)
        # Agree on the node's plan and say this side is loaded, so frames with its digest reach its scheduler. The
        # fuzzer places by memory (it measures nothing), so the ring is split by memory and it holds layers.
        linked = (link.remote.node_id,)  # the fuzzer's links, as a member announces them
        fuzzer.run(link.send(PlanState((), (InstanceState(model, None, True),), NodeLoad().to_json(),
                                       (SpeedFigures("memory").to_json(),), linked)))
        digest = wait_for(lambda: stage_digest(node, FUZZER))
        fuzzer.run(link.send(PlanState((), (InstanceState(model, digest, True, kv_blocks=64),),
                                       NodeLoad(kv_blocks=64).to_json(), (SpeedFigures("memory").to_json(),),
                                       linked)))

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(frames(digest, hidden))
        def run(frame: bytes) -> None:
            frame = harmless(frame, model)
            fuzzer.send_raw(frame)
            sent["frames"] += 1
            sent["refused"] += refused(frame)

        run()
        # Read to the end, on the same link: an announcement sent after every frame arrives.
        fuzzer.run(link.send(PlanState((), (), NodeLoad(tokens_per_second=7.5).to_json())))
        assert wait_for(lambda: (cluster_member(node, FUZZER) or {}).get("tokens_per_second") == 7.5), node.log()
        assert not link.closed and fuzzer.net.links.get(link.remote.node_id) is link
        assert wait_for(lambda: refusals(node) - before == sent["refused"]), (refusals(node) - before, sent)
        # Both kinds in numbers: frames refused, and valid ones that reached the node's handlers.
        assert sent["frames"] >= EXAMPLES and EXAMPLES // 5 <= sent["refused"] <= EXAMPLES - EXAMPLES // 5, sent
        assert any(isinstance(m, PlanState) for m in fuzzer.received)  # the node's announcements kept coming
    finally:
        fuzzer.close()
    assert_serves_and_links(node, model)


def assert_serves_and_links(node: NodeProcess, model: str) -> None:  # noqa: F811
    wait_until_ready([node], 1)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4,
                       "temperature": 0}).encode()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4
    health = node.get_json("/health")
    assert (health["in_flight_requests"], health["active_kv_caches"]) == (0, 0), health
    newcomer = LinkThread("fuzz-newcomer")
    try:
        newcomer.dial(node.port)
        assert wait_for(lambda: cluster_member(node, "fuzz-newcomer") is not None)
        assert wait_for(lambda: any(isinstance(m, PlanState) for m in newcomer.received))
    finally:
        newcomer.close()
    log = node.log()
    assert "Traceback" not in log and " ERROR " not in log, log
