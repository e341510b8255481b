"""The cluster's choice of placement from announced figures, without processes: speed or memory, waiting for
figures, a ring that goes on while a newcomer measures, and what GET /v1/cluster says about it."""

from __future__ import annotations

import asyncio

from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.speed import rtt_bucket_us
from exo_like.cluster.view import cluster_picture
from exo_like.models.footprint import ModelDescription, ModelFootprint
from partitioning.speed_figures import SpeedFigures, SpeedSource
from tests.cluster.one_model import MODEL, FakeLink, OneModel, peer_state

GIB = 1 << 30
MS = 1_000_000
# 24 layers of 10 bytes, 100 bytes of embeddings, 50 of head (untied, so the head costs 5 layers' time).
FOOTPRINT = ModelFootprint(layer_bytes=(10,) * 24, embed_bytes=100, head_bytes=50, tied=False, stored_dtype_bytes=4)


class FakeSpeed(SpeedSource):
    """This node's figures, as a test sets them."""

    def __init__(self, placement: str = "compute", decode_ns: int | None = None, problem: str | None = None):
        self.placement, self.decode_ns, self.problem = placement, decode_ns, problem
        self.asked: list[str] = []

    def figures(self, model: str | None) -> SpeedFigures:
        if self.placement == "memory" or model is None:
            return SpeedFigures(self.placement)
        return SpeedFigures(self.placement, model, self.decode_ns, None if self.decode_ns is None else 1000,
                            0.9, False, self.problem, {})

    def measure(self, model: str, group_limit: int = 1) -> None:
        self.asked.append(model)


def info(node_id: str, memory_gib: int) -> NodeInfo:
    return NodeInfo(node_id, f"name-{node_id}", "127.0.0.1", 1, "torch", "cpu", "test", memory_gib * GIB, "0")


def make_cluster(speed: FakeSpeed, peers_memory: dict[str, int], memory_gib: int = 8) -> OneModel:
    cluster = OneModel(info("a", memory_gib), lambda key: ModelDescription(24, FOOTPRINT), speed=speed)
    for node_id, memory in peers_memory.items():
        cluster.peers.links[node_id] = FakeLink(info(node_id, memory))
    cluster.links_changed()
    cluster.set_model(MODEL)
    return cluster


def announce(cluster: OneModel, node_id: str, figures: SpeedFigures | None, digest: str | None = None) -> None:
    """Peer `node_id`'s announcement: linked with every other member, as once the mesh is complete."""
    linked = tuple(sorted(cluster.member_ids() - {node_id}))
    cluster.receive(node_id, peer_state(cluster.wishes(), digest, digest is not None, linked, figures))


def picture_of(cluster: OneModel) -> dict:
    return cluster_picture(cluster.cluster, cluster.instances)


def measured(decode_ns: int, placement: str = "compute", rtt_us: dict[str, int] | None = None) -> SpeedFigures:
    return SpeedFigures(placement, MODEL, decode_ns, 1000, 0.9, False, None, rtt_us or {})


def layers(cluster: OneModel) -> dict[str, int]:
    assert cluster.plan is not None
    return {s.node_id: s.layer_count for s in cluster.plan.stages}


async def test_a_slow_node_gets_fewer_layers_and_the_picture_says_why() -> None:
    cluster = make_cluster(FakeSpeed(decode_ns=2 * MS), {"b": 8, "c": 8})
    announce(cluster, "b", None)
    announce(cluster, "c", None)
    assert cluster.plan is None and "waiting for nodes b, c to measure" in cluster.why_not_ready()
    announce(cluster, "b", measured(8 * MS))
    assert cluster.plan is None and "waiting for nodes c to measure" in cluster.why_not_ready()
    announce(cluster, "c", measured(2 * MS))
    split = layers(cluster)
    assert split["b"] < split["a"] and split["b"] < split["c"] and sum(split.values()) == 24
    assert cluster.plan.stages[-1].node_id != "b"  # the head (5 layers' worth) goes to a fast node
    picture = picture_of(cluster)
    placement = picture["placement"]
    assert placement["mode"] == "compute" and "measured speed" in placement["why"]
    nodes = {n["id"]: n for n in picture["nodes"]}
    assert nodes["b"]["speed"]["decode_ms_per_layer"] == 8.0 and nodes["a"]["speed"]["measure_seconds"] == 0.9
    assert sum(n["share"] for n in nodes.values()) == pytest_approx(1.0)
    assert sum(n["bottleneck"] for n in nodes.values()) == 1
    bottleneck = placement["bottleneck"]
    assert nodes[bottleneck]["stage_ms"] == placement["bottleneck_ms"] == max(n["stage_ms"] for n in nodes.values())
    assert placement["time_per_token_ms"] == pytest_approx(sum(n["stage_ms"] for n in nodes.values()))
    assert placement["left_out"] == []
    await asyncio.sleep(0)
    sent = cluster.peers.links["b"].sent[-1]
    assert SpeedFigures.from_json(sent.figures[0]).decode_ns == 2 * MS  # this node's figures go to every peer


def pytest_approx(value: float):  # type: ignore[no-untyped-def]
    import pytest

    return pytest.approx(value, abs=0.01)


async def test_equal_speeds_give_the_memory_split() -> None:
    cluster = make_cluster(FakeSpeed(decode_ns=10 * MS), {"b": 3, "c": 1}, memory_gib=6)
    announce(cluster, "b", measured(11 * MS))  # within 50 %: the same hardware, measured with noise
    announce(cluster, "c", measured(15 * MS))
    assert [(s.node_id, s.start_layer, s.end_layer) for s in cluster.plan.stages] == [
        ("a", 0, 15), ("b", 15, 22), ("c", 22, 24)]  # 24 layers over 6, 3 and 1 GiB
    assert cluster.placement.why.startswith("speeds within 50 %")


async def test_a_node_asking_for_memory_placement_makes_the_memory_split() -> None:
    cluster = make_cluster(FakeSpeed(decode_ns=2 * MS), {"b": 8, "c": 8})
    announce(cluster, "b", measured(8 * MS))
    announce(cluster, "c", SpeedFigures("memory"))
    assert layers(cluster) == {"a": 8, "b": 8, "c": 8}
    picture = picture_of(cluster)["placement"]
    assert picture["mode"] == "memory" and picture["why"] == "split by memory: name-c runs with --placement memory"
    assert picture["time_per_token_ms"] is None  # c measured nothing: no stage times to show


async def test_memory_placement_shows_the_bottleneck_when_every_stage_is_measured() -> None:
    cluster = make_cluster(FakeSpeed("memory"), {"b": 8, "c": 8})
    announce(cluster, "b", measured(8 * MS))
    announce(cluster, "c", measured(2 * MS))
    assert layers(cluster) == {"a": 8, "b": 8, "c": 8}
    assert cluster.placement.why == "split by memory: this node runs with --placement memory"
    assert cluster.placement.stage_ns == {}  # this node measured nothing (it places by memory)


async def test_a_failed_measurement_falls_back_to_the_memory_split_and_says_why() -> None:
    cluster = make_cluster(FakeSpeed(problem="cannot measure its speed: no engine"), {"b": 8})
    announce(cluster, "b", measured(8 * MS))
    assert layers(cluster) == {"a": 12, "b": 12}
    assert cluster.placement.why == "split by memory: name-a cannot measure its speed: no engine"


async def test_a_ring_goes_on_while_a_newcomer_measures_then_takes_it_in() -> None:
    cluster = make_cluster(FakeSpeed(decode_ns=2 * MS), {"b": 8})
    announce(cluster, "b", measured(2 * MS))
    serving = cluster.plan
    assert serving is not None and layers(cluster) == {"a": 12, "b": 12}
    announce(cluster, "b", measured(2 * MS), serving.digest)
    assert cluster.agreed
    cluster.peers.links["n"] = FakeLink(info("n", 8))  # a newcomer, measuring
    cluster.links_changed()
    assert cluster.plan == serving and cluster.agreed  # the ring goes on while n links with every member
    announce(cluster, "b", measured(2 * MS), serving.digest)  # b is linked with n too
    announce(cluster, "n", SpeedFigures("compute", MODEL))  # announced: still measuring
    assert cluster.plan == serving and cluster.agreed  # the ring goes on without it
    left_out = picture_of(cluster)["placement"]["left_out"]
    assert left_out == [{"node_id": "n", "name": "name-n",
                         "reason": "measuring its speed: it joins the ring once measured"}]
    announce(cluster, "n", measured(2 * MS))
    assert cluster.plan != serving and set(layers(cluster)) == {"a", "b", "n"}
    assert not cluster.agreed  # every member must announce the new plan now


async def test_a_node_that_only_slows_the_ring_is_left_out_and_named() -> None:
    cluster = make_cluster(FakeSpeed(decode_ns=MS), {"slow": 8})
    announce(cluster, "slow", measured(400 * MS))
    assert layers(cluster) == {"a": 24}
    (left,) = picture_of(cluster)["placement"]["left_out"]
    assert left["node_id"] == "slow" and left["reason"].startswith("with it the slowest stage takes")


async def test_link_round_trips_are_read_alike_from_both_ends() -> None:
    cluster = make_cluster(FakeSpeed(decode_ns=MS), {"b": 8})
    announce(cluster, "b", measured(2 * MS, rtt_us={"a": 64 * 1024}))  # a slow link, as b measured it
    # 24 layers: alone 24 ms + 5 ms of head; with b each stage pays 32 ms one way: a alone is faster.
    assert layers(cluster) == {"a": 24}
    assert rtt_bucket_us(None) == 2048 and rtt_bucket_us(0.0001) == 2048 and rtt_bucket_us(0.0019) == 2048
    assert rtt_bucket_us(0.0021) == 4096 and rtt_bucket_us(0.05) == 65536


async def test_a_refined_figure_that_keeps_the_stages_keeps_the_plan_and_its_requests() -> None:
    """The digest covers the ring, not the figures: a round trip moving to another bucket re-plans, and a plan with
    the same stages is the same plan (the stage does not restart the requests running on it)."""
    cluster = make_cluster(FakeSpeed(decode_ns=2 * MS), {"b": 8})
    announce(cluster, "b", measured(8 * MS))
    serving = cluster.plan
    before = picture_of(cluster)["placement"]["time_per_token_ms"]
    announce(cluster, "b", measured(8 * MS, rtt_us={"a": 4096}))
    assert cluster.plan is serving
    assert picture_of(cluster)["placement"]["time_per_token_ms"] > before  # the picture follows the figures
