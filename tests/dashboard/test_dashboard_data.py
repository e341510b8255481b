"""What the dashboard's picture is made of, without processes: rates, shared load, bytes per node, lost nodes, each
member's part in a plan with a tensor-parallel group."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Callable

import pytest

import exo_like.cluster.membership as cluster_module
from exo_like.cluster.membership import DEPARTED_SHOWN_SECONDS
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.protocol import PlanState
from exo_like.cluster.view import cluster_picture
from exo_like.meter import RateMeter, RecentMedian
from exo_like.models.footprint import ModelDescription, ModelFootprint
from partitioning import Stage
from partitioning.decision import PlacementReport
from partitioning.plan import Plan
from partitioning.speed_figures import SpeedFigures
from tests.cluster.one_model import FakeLink, OneModel, peer_state

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


def info(node_id: str, memory: int) -> NodeInfo:
    return NodeInfo(node_id, f"name-{node_id}", "127.0.0.1", 1, "torch", "cpu", "test", memory, "0")


def make_cluster(local_load: NodeLoad | Callable[[], NodeLoad]) -> tuple[OneModel, SimpleNamespace]:
    current = local_load if callable(local_load) else lambda: local_load
    cluster = OneModel(info("a", 2 * GIB), lambda key: ModelDescription(7, FOOTPRINT), current_load=current)
    return cluster, cluster.peers


def announcement_from(cluster: OneModel, load: NodeLoad) -> PlanState:
    """What peer b sends once it has the same plan (built from our own: same instances and digest)."""
    digest = cluster.plan.digest if cluster.plan is not None else None
    return peer_state(cluster.wishes(), digest, True, (cluster.cluster.me.node_id,), load=load)


def picture_of(cluster: OneModel, now: float | None = None) -> dict:
    return cluster_picture(cluster.cluster, cluster.instances, now=now)


async def test_picture_has_bytes_per_node_and_every_members_shared_load() -> None:
    cluster, peers = make_cluster(NodeLoad(tokens_per_second=8.0, generated_per_second=8.0, in_flight=1, busy=True))
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    cluster.set_model("m")
    cluster.receive("b", announcement_from(cluster, NodeLoad(tokens_per_second=8.0, busy=True)))
    picture = picture_of(cluster)
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
                                                 "preemptions": 0, "draft_tokens": 0, "accepted_tokens": 0, "drafts": 0,
                                                 "quantized_weights": {},
                                                 "dequantized_weights": {}, "numerics": {}, "replays": 0,
                                                 "recovering": {}}


def tensor_parallel_cluster() -> OneModel:
    """Four members (this node "a" among them) on a plan of two stages: d alone runs layers [0, 3), a
    tensor-parallel group led by b (followers a and c) runs [3, 7); placed by the auto rule, which predicted the
    groups 5 ms per token against the pipeline's 7.5 ms. The stages' leaders have measured decode steps (a
    group's step is its leader's); the followers have none. Call it inside a running event loop."""
    cluster, peers = make_cluster(NodeLoad())
    for node_id, memory in (("b", 2 * GIB), ("c", 2 * GIB), ("d", 4 * GIB)):
        peers.links[node_id] = FakeLink(info(node_id, memory))
    cluster.links_changed()
    cluster.set_model("m")
    plan = Plan("m", 7, (Stage("d", 0, 3), Stage("b", 3, 7, ("a", "c"))),
                (("a", 2 * GIB), ("b", 2 * GIB), ("c", 2 * GIB), ("d", 4 * GIB)))
    steps = {"b": 3.4, "c": None, "d": 1.9}
    for node_id, step in steps.items():
        load = NodeLoad(decode_step_ms=step)
        figures = SpeedFigures(model="m", decode_ns=700_000 if node_id == "d" else 1_100_000, measure_seconds=0.4)
        cluster.receive(node_id, peer_state(cluster.wishes(), plan.digest, True,
                                            tuple(sorted({"a", "b", "c", "d"} - {node_id})), figures, load))
    # The plan and its report as the placer would give them (the fakes announce no speed figures to place by).
    instance = cluster.instance
    instance.plan, instance.problem, instance.loaded_digest = plan, None, plan.digest
    instance.placement = PlacementReport(
        "tensor", "tensor parallel: 5.0 ms per token predicted against 7.5 ms for the pipeline",
        {"d": 2_000_000, "b": 3_000_000}, "b", predicted={"pipeline": 7_500_000, "tensor": 5_000_000})
    return cluster


async def test_picture_gives_every_member_its_part_in_a_plan_with_a_tensor_parallel_group() -> None:
    cluster = tensor_parallel_cluster()
    picture = picture_of(cluster)
    assert picture["ready"] and picture["agreed"]
    assert picture["plan"]["stages"] == [{"node_id": "d", "start_layer": 0, "end_layer": 3},
                                         {"node_id": "b", "start_layer": 3, "end_layer": 7, "group": ["b", "a", "c"]}]
    nodes = {n["id"]: n for n in picture["nodes"]}
    parts = {node_id: (n["stage"], n["start_layer"], n["end_layer"], n["tp"]) for node_id, n in nodes.items()}
    assert parts == {"d": (0, 0, 3, None),  # a stage alone
                     "b": (1, 3, 7, {"rank": 0, "size": 3, "leader": "b"}),
                     "a": (1, 3, 7, {"rank": 1, "size": 3, "leader": "b"}),  # followers: the leader's range
                     "c": (1, 3, 7, {"rank": 2, "size": 3, "leader": "b"})}
    # Every rank holds its slice of the group's 4 layers (40 bytes split 3 ways: 14), the leader of the last stage
    # also the head; the first stage its 3 layers and the embeddings.
    assert {node_id: n["used_bytes"] for node_id, n in nodes.items()} == {"d": 3 * 10 + 100, "b": 14 + 50, "a": 14,
                                                                          "c": 14}
    # The group's predicted stage time and its measured step are on its leader's entry; followers show their rank,
    # not a share of the time per token.
    assert (nodes["b"]["stage_ms"], nodes["b"]["share"], nodes["b"]["bottleneck"], nodes["b"]["decode_step_ms"]) \
        == (3.0, 0.6, True, 3.4)
    for follower in ("a", "c"):
        assert (nodes[follower]["stage_ms"], nodes[follower]["share"], nodes[follower]["bottleneck"]) \
            == (None, None, False)
    assert (nodes["d"]["stage_ms"], nodes["d"]["share"], nodes["d"]["decode_step_ms"]) == (2.0, 0.4, 1.9)
    placement = picture["placement"]
    assert placement["mode"] == "tensor"
    assert placement["predicted_ms"] == {"pipeline": 7.5, "tensor": 5.0}
    assert placement["time_per_token_ms"] == 5.0 and placement["bottleneck_ms"] == 3.0
    assert placement["measured_time_per_token_ms"] == 5.3  # the stages' measured steps: d's and b's for its group


async def test_a_member_outside_the_plan_has_no_part_and_the_measured_time_waits_for_every_stage() -> None:
    cluster, peers = make_cluster(NodeLoad(decode_step_ms=2.0))
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    cluster.set_model("m")
    cluster.instance.plan = Plan("m", 7, (Stage("a", 0, 7),), (("a", 2 * GIB), ("b", GIB)))
    cluster.instance.placement = PlacementReport("memory", "split by memory: this node runs with --placement memory",
                                        {"a": 2_000_000}, "a")
    picture = picture_of(cluster)
    parts = {n["id"]: (n["stage"], n["start_layer"], n["end_layer"], n["tp"]) for n in picture["nodes"]}
    assert parts == {"a": (0, 0, 7, None), "b": (None, None, None, None)}
    assert picture["placement"]["measured_time_per_token_ms"] == 2.0
    cluster.instance.plan = Plan("m", 7, (Stage("a", 0, 4), Stage("b", 4, 7)), (("a", 2 * GIB), ("b", GIB)))
    assert picture_of(cluster)["placement"]["measured_time_per_token_ms"] is None  # b has no step yet


async def test_lost_member_is_listed_unreachable_for_a_while_then_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(cluster_module, "time", SimpleNamespace(monotonic=clock))
    cluster, peers = make_cluster(NodeLoad())
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    assert picture_of(cluster, clock())["departed"] == []
    del peers.links["b"]
    cluster.links_changed()
    clock.now += 3.0
    picture = picture_of(cluster, clock())
    assert [n["id"] for n in picture["nodes"]] == ["a"]  # members only: the lost node is not in the ring
    assert [(n["id"], n["name"], n["status"], n["lost_seconds_ago"]) for n in picture["departed"]] == [
        ("b", "name-b", "unreachable", 3.0)]
    clock.now += DEPARTED_SHOWN_SECONDS
    assert picture_of(cluster, clock())["departed"] == []
    peers.links["b"] = FakeLink(info("b", GIB))  # back again: a member, not departed
    cluster.links_changed()
    del peers.links["b"]
    cluster.links_changed()
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    assert picture_of(cluster, clock())["departed"] == []


async def test_wait_change_wakes_every_watcher_on_an_announcement() -> None:
    cluster, peers = make_cluster(NodeLoad())
    peers.links["b"] = FakeLink(info("b", GIB))
    cluster.links_changed()
    await asyncio.sleep(0)
    # No timeout can end the wait while the test runs: ending at all means the announcement woke them.
    watchers = [asyncio.ensure_future(cluster.cluster.wait_change(3600.0)) for _ in range(3)]
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
    cluster.cluster.start()
    try:
        for working in (True, False):
            await asyncio.sleep(0.05)
            load = NodeLoad(in_flight=int(working), busy=working)
            changed = time.monotonic()
            while not link.sent or link.sent[-1].load["busy"] != working:
                assert time.monotonic() - changed < HANG_SECONDS, "not announced by the activity poll"
                await asyncio.sleep(0.01)
    finally:
        await cluster.cluster.stop()
