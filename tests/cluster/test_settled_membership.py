"""Plans only over a membership every member sees (exo_like/membership.py), without processes: the rule itself,
and three nodes' clusters through a join by one member's address (links forming one at a time) and a loss."""

from __future__ import annotations


from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.settled import meshed, unsettled
from exo_like.models.footprint import ModelDescription, ModelFootprint
from tests.cluster.one_model import FakeLink, OneModel

GIB = 1 << 30
FOOTPRINT = ModelFootprint(layer_bytes=(10,) * 12, embed_bytes=100, head_bytes=50, tied=False, stored_dtype_bytes=4)
MEMORY = {"a": 6, "b": 4, "c": 2}


# -- the rule -----------------------------------------------------------------------------------------------

def test_a_view_is_settled_when_every_linked_peer_announced_the_same_members() -> None:
    assert unsettled("a", set(), {}) is None  # alone
    assert unsettled("a", {"b", "c"}, {"b": {"a", "c"}, "c": {"a", "b"}}) is None


def test_a_view_is_unsettled_while_a_peer_has_not_announced_or_sees_other_members() -> None:
    assert unsettled("a", {"b", "c"}, {"b": {"a", "c"}}) == "node c has not announced its links yet"
    # The bootstrap member during a join: c linked with it alone, b not yet linked with c.
    assert unsettled("a", {"b", "c"}, {"b": {"a"}, "c": {"a"}}) == "node b is not linked with c yet"
    # The other member, and the newcomer: a peer linked with a node this one is not linked with.
    assert unsettled("b", {"a"}, {"a": {"b", "c"}}) == "node a is linked with c, which this node is not linked with yet"
    assert unsettled("c", {"a"}, {"a": {"b", "c"}}) == "node a is linked with b, which this node is not linked with yet"


def test_nodes_are_meshed_when_each_is_linked_with_every_other() -> None:
    announced = {"b": {"a"}, "c": {"a"}}  # a is linked with b and c, which are not linked with each other
    assert meshed(["a", "b"], "a", {"b", "c"}, announced)
    assert meshed(["a"], "a", {"b", "c"}, announced)
    assert not meshed(["a", "b", "c"], "a", {"b", "c"}, announced)
    assert not meshed(["b", "c"], "a", {"b", "c"}, announced)  # a plan without this node needs them linked too
    assert not meshed(["a", "b"], "a", {"c"}, announced)  # this node lost b
    assert not meshed(["a", "b"], "a", {"b"}, {})  # b has not said whom it is linked with


# -- three clusters through a join ----------------------------------------------------------------------------

def info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, f"name-{node_id}", "127.0.0.1", 1, "torch", "cpu", "test", MEMORY[node_id] * GIB, "0")


class Nodes:
    """Each node's Cluster (placing by memory), links made and lost by the test, announcements delivered by it."""

    def __init__(self, *node_ids: str, without_model: tuple[str, ...] = ()):
        """without_model: nodes started without --model (they adopt the cluster's)."""
        self.clusters: dict[str, OneModel] = {}
        for node_id in node_ids:
            self.clusters[node_id] = OneModel(info(node_id), lambda key: ModelDescription(12, FOOTPRINT))
            if node_id not in without_model:
                self.clusters[node_id].set_model("m")

    def link(self, one: str, other: str) -> None:
        for here, there in ((one, other), (other, one)):
            self.clusters[here].peers.links[there] = FakeLink(info(there))
            self.clusters[here].links_changed()

    def cut(self, one: str, other: str) -> None:
        for here, there in ((one, other), (other, one)):
            del self.clusters[here].peers.links[there]
            self.clusters[here].links_changed()

    def announce(self, sender: str) -> None:
        """What `sender` announces now, delivered to each peer it is linked with."""
        message = self.clusters[sender].announcement()
        for peer in self.clusters[sender].peers.links:
            self.clusters[peer].receive(sender, message)

    def announce_all(self, rounds: int = 2) -> None:
        for _ in range(rounds):
            for node_id in self.clusters:
                self.announce(node_id)

    def stages(self, node_id: str) -> list[str] | None:
        plan = self.clusters[node_id].plan
        return None if plan is None else list(plan.node_ids)

    def digests(self) -> set[str | None]:
        return {c.plan.digest if c.plan else None for c in self.clusters.values()}


async def test_a_node_joining_through_one_member_never_makes_the_members_disagree() -> None:
    nodes = Nodes("a", "b", "c")
    nodes.link("a", "b")
    nodes.announce_all()
    serving = nodes.clusters["a"].plan
    assert nodes.stages("a") == nodes.stages("b") == ["a", "b"] and nodes.clusters["a"].agreed

    nodes.link("a", "c")  # c was given a's address only
    nodes.announce_all()
    # a and b keep the plan that serves; c, which sees a linked with b, makes no plan without b (it keeps the one
    # it served alone: the model was set on it before it linked).
    assert nodes.clusters["a"].plan == nodes.clusters["b"].plan == serving
    assert nodes.clusters["a"].agreed and nodes.clusters["b"].agreed
    assert nodes.stages("c") == ["c"]
    assert nodes.clusters["a"].unsettled == "node b is not linked with c yet"
    assert nodes.clusters["b"].unsettled == "node a is linked with c, which this node is not linked with yet"
    assert nodes.clusters["c"].unsettled == "node a is linked with b, which this node is not linked with yet"

    nodes.link("b", "c")  # peer exchange told b and c of each other
    assert nodes.clusters["a"].plan == serving  # until every member has said so
    nodes.announce_all()
    assert nodes.stages("a") == nodes.stages("b") == nodes.stages("c") == ["a", "b", "c"]
    assert len(nodes.digests()) == 1 and all(c.agreed for c in nodes.clusters.values())


async def test_a_newcomer_without_a_plan_makes_none_until_it_is_linked_with_every_member() -> None:
    nodes = Nodes("a", "b", "c", without_model=("c",))  # c adopts the cluster's model from a's announcement
    nodes.link("a", "b")
    nodes.link("a", "c")
    nodes.announce_all()
    assert nodes.clusters["c"].model_id == "m" and nodes.clusters["c"].plan is None
    assert "waiting for the members to link with each other (node a is linked with b" in \
        nodes.clusters["c"].why_not_ready()
    nodes.link("b", "c")
    nodes.announce_all()
    assert nodes.stages("c") == ["a", "b", "c"] and len(nodes.digests()) == 1


async def test_a_node_that_lost_a_stage_drops_the_plan_until_the_rest_agree_on_the_members() -> None:
    nodes = Nodes("a", "b", "c")
    for one, other in (("a", "b"), ("a", "c"), ("b", "c")):
        nodes.link(one, other)
    nodes.announce_all()
    assert nodes.stages("a") == ["a", "b", "c"] and len(nodes.digests()) == 1

    del nodes.clusters["a"].peers.links["c"]  # a noticed that c is gone; b has not yet
    nodes.clusters["a"].links_changed()
    nodes.announce("b")
    assert nodes.clusters["a"].plan is None  # no plan over members b does not see alike
    assert nodes.clusters["a"].unsettled == "node b is linked with c, which this node is not linked with yet"
    del nodes.clusters["b"].peers.links["c"]
    nodes.clusters["b"].links_changed()
    nodes.announce_all()
    assert nodes.stages("a") == nodes.stages("b") == ["a", "b"]
    assert nodes.clusters["a"].agreed and nodes.clusters["b"].agreed


async def test_a_stage_link_lost_between_two_peers_ends_the_plan_that_needs_it() -> None:
    nodes = Nodes("a", "b", "c")
    for one, other in (("a", "b"), ("a", "c"), ("b", "c")):
        nodes.link(one, other)
    nodes.announce_all()
    nodes.cut("b", "c")  # both still linked with a
    nodes.announce_all()
    assert nodes.digests() == {None}  # nobody serves a ring whose stages cannot reach each other
    assert nodes.clusters["a"].unsettled == "node b is not linked with c yet"
