"""What the dashboard's picture is made of, without processes: rates, shared load, bytes per node, lost nodes."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Callable

import pytest

import exo_like.cluster.membership as cluster_module
from exo_like.cluster.link_problems import LinkProblems
from exo_like.cluster.membership import DEPARTED_SHOWN_SECONDS, Cluster
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.protocol import PlanState
from exo_like.cluster.view import cluster_picture
from exo_like.meter import RateMeter, RecentMedian
from exo_like.models.footprint import ModelDescription, ModelFootprint
from exo_like.models.shard import Shard
from partitioning.plan import Plan

GIB = 1 << 30
# 7 layers of 10 bytes, 100 bytes of embeddings, 50 of final norm + head (untied).
FOOTPRINT = ModelFootprint(layer_bytes=(10,) * 7, embed_bytes=100, head_bytes=50, tied=False, stored_dtype_bytes=4)


HANG_SECONDS = 60.0  # only a guard against hanging: what is asserted does not depend on how fast this machine is


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_meter_counts_the_last_window_only() -> None:
    clock = FakeClock()
    meter = RateMeter(window=2.0, clock=clock)
    assert meter.rate() == 0.0
    for _ in range(10):
        meter.add()
        clock.now += 0.1
    assert meter.rate() == pytest.approx(5.0)  # 10 events in the last 2 s
    clock.now += 1.15  # the first two events (at 1000.0 and 1000.1) fall out of the window
    assert meter.rate() == pytest.approx(4.0)
    meter.add(3)
    assert meter.rate() == pytest.approx(5.5)
    clock.now += 2.0
    assert meter.rate() == 0.0


def test_recent_median_keeps_the_last_values_only() -> None:
    steps = RecentMedian(size=3)
    assert steps.median() is None
    for value in (0.5, 0.01, 0.02):
        steps.add(value)
    assert steps.median() == 0.02  # one slow step does not move it
    steps.add(0.03)  # 0.5 falls out
    assert steps.median() == 0.02
    steps.add(0.04)
    assert steps.median() == 0.03


def test_node_load_round_trips_and_tolerates_old_peers() -> None:
    load = NodeLoad(tokens_per_second=12.345, generated_per_second=3.0, in_flight=2, busy=True, step_seconds=4.26,
                    decode_step_ms=12.3456)
    assert NodeLoad.from_json(load.to_json()) == NodeLoad(12.35, 3.0, 2, True, step_seconds=4.3,
                                                          decode_step_ms=12.35)
    assert NodeLoad.from_json(NodeLoad().to_json()).decode_step_ms is None  # no decode step yet
    assert NodeLoad.from_json(None) == NodeLoad()


class FakeLink:
    def __init__(self, remote: NodeInfo):
        self.remote = remote
        self.closed = False
        self.sent: list[PlanState] = []

    async def send(self, message: PlanState) -> None:
        self.sent.append(message)


def info(node_id: str, memory: int) -> NodeInfo:
    return NodeInfo(node_id, f"name-{node_id}", "127.0.0.1", 1, "torch", "cpu", "test", memory, "0")


async def no_load(plan: Plan, shard: Shard | None) -> None:
    pass


def make_cluster(local_load: NodeLoad | Callable[[], NodeLoad]) -> tuple[Cluster, SimpleNamespace]:
    peers = SimpleNamespace(links={}, problems=LinkProblems("a"))
    current = local_load if callable(local_load) else lambda: local_load
    cluster = Cluster(info("a", 2 * GIB), peers, lambda key: ModelDescription(7, FOOTPRINT), no_load,
                      lambda live: None, current)
    return cluster, peers


def announcement_from(cluster: Cluster, load: NodeLoad) -> PlanState:
    """What peer b sends once it has the same plan (built from our own announcement: same model and digest)."""
    mine = cluster.my_announcement()
    return PlanState(mine.model, mine.clock, mine.digest, True, None, load.to_json(), linked=(cluster.me.node_id,))


async def test_picture_has_bytes_per_node_and_every_members_shared_load() -> None:
    cluster, peers = make_cluster(NodeLoad(tokens_per_second=8.0, generated_per_second=8.0, in_flight=1, busy=True))
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    cluster.set_model("m")
    cluster.receive("b", announcement_from(cluster, NodeLoad(tokens_per_second=8.0, busy=True)))
    picture = cluster_picture(cluster)
    stages = {s["node_id"]: (s["start_layer"], s["end_layer"]) for s in picture["plan"]["stages"]}
    assert stages == {"a": (0, 5), "b": (5, 7)}  # 7 layers over 2 and 1 GiB
    nodes = {n["id"]: n for n in picture["nodes"]}
    assert nodes["a"]["used_bytes"] == 5 * 10 + 100  # its layers and the embeddings
    assert nodes["b"]["used_bytes"] == 2 * 10 + 50  # its layers and the head
    assert picture["model_bytes"] == 7 * 10 + 100 + 50
    assert picture["total_memory_bytes"] == 3 * GIB
    assert (nodes["a"]["tokens_per_second"], nodes["a"]["in_flight"], nodes["a"]["busy"]) == (8.0, 1, True)
    assert (nodes["b"]["tokens_per_second"], nodes["b"]["in_flight"], nodes["b"]["busy"]) == (8.0, 0, True)
    assert picture["tokens_per_second"] == 8.0  # counted once, where it is streamed
    assert picture["requests_in_flight"] == 1
    await asyncio.sleep(0)  # let the announcement tasks run
    assert peers.links["b"].sent[-1].load == {"tokens_per_second": 8.0, "generated_per_second": 8.0,
                                                 "in_flight": 1, "busy": True, "step_seconds": 0.0,
                                                 "decode_step_ms": None, "kv_blocks": 0, "kv_used": 0,
                                                 "kv_window_blocks": 0, "running": 0,
                                                 "waiting": 0, "prefix_queries": 0, "prefix_hits": 0,
                                                 "preemptions": 0, "quantized_weights": {},
                                                 "dequantized_weights": {}, "numerics": {}, "replays": 0,
                                                 "recovering": {}}


async def test_lost_member_is_listed_unreachable_for_a_while_then_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(cluster_module, "time", SimpleNamespace(monotonic=clock))
    cluster, peers = make_cluster(NodeLoad())
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    assert cluster_picture(cluster, clock())["departed"] == []
    del peers.links["b"]
    cluster.links_changed()
    clock.now += 3.0
    picture = cluster_picture(cluster, clock())
    assert [n["id"] for n in picture["nodes"]] == ["a"]  # members only: the lost node is not in the ring
    assert [(n["id"], n["name"], n["status"], n["lost_seconds_ago"]) for n in picture["departed"]] == [
        ("b", "name-b", "unreachable", 3.0)]
    clock.now += DEPARTED_SHOWN_SECONDS
    assert cluster_picture(cluster, clock())["departed"] == []
    peers.links["b"] = FakeLink(info("b", GIB))  # back again: a member, not departed
    cluster.links_changed()
    del peers.links["b"]
    cluster.links_changed()
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    assert cluster_picture(cluster, clock())["departed"] == []


async def test_wait_change_wakes_every_watcher_on_an_announcement() -> None:
    cluster, peers = make_cluster(NodeLoad())
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    await asyncio.sleep(0)
    # No timeout can end the wait while the test runs: ending at all means the announcement woke them.
    watchers = [asyncio.ensure_future(cluster.wait_change(3600.0)) for _ in range(3)]
    await asyncio.sleep(0)
    cluster.receive("b", announcement_from(cluster, NodeLoad()))
    await asyncio.wait_for(asyncio.gather(*watchers), HANG_SECONDS)


async def test_a_node_announces_at_once_when_it_starts_or_stops_working(monkeypatch: pytest.MonkeyPatch) -> None:
    # No periodic announcement while the test runs: one that carries the change came from the activity poll.
    monkeypatch.setattr(cluster_module, "ANNOUNCE_INTERVAL", 3600.0)
    load = NodeLoad()
    cluster, peers = make_cluster(lambda: load)
    link = peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    cluster.start()
    try:
        for working in (True, False):
            await asyncio.sleep(0.05)
            load = NodeLoad(in_flight=int(working), busy=working)
            changed = time.monotonic()
            while not link.sent or link.sent[-1].load["busy"] != working:
                assert time.monotonic() - changed < HANG_SECONDS, "not announced by the activity poll"
                await asyncio.sleep(0.01)
    finally:
        await cluster.stop()
