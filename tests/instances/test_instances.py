"""The instances of one node's view, without processes: several instances of one model on the nodes asked for
(data parallel), each with its own plan and key, unloaded one by one or all at once; a request goes to the ready
instance with the fewest requests."""

from __future__ import annotations

from exo_like.cluster.node_info import NodeInfo
from exo_like.models.footprint import ModelDescription, ModelFootprint
from tests.cluster.one_model import FakeLink, OneModel, peer_state

GIB = 1 << 30
FOOTPRINT = ModelFootprint(layer_bytes=(10,) * 8, embed_bytes=100, head_bytes=50, tied=False, stored_dtype_bytes=4)


def info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, f"name-{node_id}", "127.0.0.1", 1, "torch", "cpu", "test", 8 * GIB, "0")


def four_nodes() -> OneModel:
    node = OneModel(info("a"), lambda key: ModelDescription(8, FOOTPRINT))
    for peer in "bcd":
        node.peers.links[peer] = FakeLink(info(peer))
    node.links_changed()
    for peer in "bcd":  # each linked with every other member, placing by memory
        node.receive(peer, peer_state((), None, False, tuple(sorted(set("abcd") - {peer}))))
    return node


async def test_a_model_asked_for_on_other_nodes_gets_another_instance_there() -> None:
    node = four_nodes()
    first = node.instances.pin("m", ("a", "b"))
    second = node.instances.pin("m", ("c", "d"))
    assert (first.key, second.key) == ("m", "m#2")
    assert set(first.plan.node_ids) <= {"a", "b"} and set(second.plan.node_ids) <= {"c", "d"}
    assert first.plan.digest != second.plan.digest  # messages reach the right instance by their plan's digest
    assert node.instances.pin("m", ("a", "b")) is first  # asked for again where it runs: the same instance
    assert [i.key for i in node.instances.of("m")] == ["m", "m#2"]
    states = node.announcement().instances
    assert [(s.model, s.key) for s in states] == [("m", "m"), ("m", "m#2")]


async def test_instances_unload_one_by_one_or_all_with_their_model() -> None:
    node = four_nodes()
    node.instances.pin("m", ("a", "b"))
    node.instances.pin("m", ("c", "d"))
    assert node.instances.unload("m#2") and [i.key for i in node.instances.of("m")] == ["m"]
    assert not node.instances.unload("m#2")  # gone already
    node.instances.pin("m", ("c", "d"))
    assert node.instances.unload("m") and node.instances.of("m") == []


async def test_a_request_goes_to_the_ready_instance_with_the_fewest_requests() -> None:
    node = four_nodes()
    first = node.instances.pin("m", ("a", "b"))
    second = node.instances.pin("m", ("c", "d"))
    assert node.instances.require("m") is first  # neither ready: the oldest
    for peer in "cd":  # c and d have loaded the second instance's layers; a and b nothing yet
        node.receive(peer, peer_state(node.wishes(), second.plan.digest, True, tuple(sorted(set("abcd") - {peer})),
                                      model="m", instance="m#2"))
    assert second.ready and not first.ready
    assert node.instances.require("m") is second


async def test_two_nodes_asked_for_different_models_at_once_converge_on_one_set_of_instances() -> None:
    nodes = {node_id: OneModel(info(node_id), lambda key: ModelDescription(8, FOOTPRINT)) for node_id in "ab"}
    for here, there in (("a", "b"), ("b", "a")):
        nodes[here].peers.links[there] = FakeLink(info(there))
        nodes[here].links_changed()
    nodes["a"].instances.require("x")  # at the same moment, before either heard of the other's
    nodes["b"].instances.require("y")
    for _ in range(2):
        for here, there in (("a", "b"), ("b", "a")):
            nodes[there].receive(here, nodes[here].announcement())
    for node in nodes.values():
        assert [i.key for i in node.instances.instances.values()] == ["x", "y"]  # by (clock, writer): a's first
    plans = [{key: i.plan.digest for key, i in node.instances.instances.items()} for node in nodes.values()]
    assert plans[0] == plans[1] and None not in plans[0].values()


async def test_a_lost_node_re_plans_only_the_instances_it_was_part_of() -> None:
    node = four_nodes()
    x = node.instances.pin("x", ("a", "b"))
    y = node.instances.pin("y", ("c", "d"))
    before = (x.plan.digest, y.plan.digest)
    del node.peers.links["d"]  # d is lost
    node.links_changed()
    assert x.plan.digest == before[0]  # x never ran on d: its requests go on undisturbed
    assert y.plan is None  # until the others say they lost d too
    for peer in "bc":
        node.receive(peer, peer_state(node.wishes(), None, False, tuple(sorted(set("abc") - {peer}))))
    assert x.plan.digest == before[0]
    assert y.plan is not None and y.plan.digest != before[1] and set(y.plan.node_ids) == {"c"}
