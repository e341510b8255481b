"""Plans with tensor-parallel stages: groups of same-engine nodes in ring order, layers split over groups and single
nodes by memory, each member's shard its rank's slice; --parallel tensor only when every member asks for it."""

from __future__ import annotations

from dataclasses import dataclass

from exo_like.models.footprint import ModelFootprint
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import TensorSplit
from partitioning import NodeCapacity
from partitioning.decision import Placer
from partitioning.plan import Plan, fit_problems
from partitioning.ring import Stage
from partitioning.speed_figures import SpeedFigures
from partitioning.tensor import tensor_groups, tensor_stages

GIB = 1 << 30
FOOTPRINT = ModelFootprint(layer_bytes=(GIB,) * 8, embed_bytes=GIB // 4, head_bytes=GIB // 4, tied=False,
                           stored_dtype_bytes=2)


@dataclass(frozen=True)
class Member:
    node_id: str
    engine: str
    memory_bytes: int
    name: str = ""
    device: str = "cpu"
    dtype: str | None = None


def test_nodes_of_one_engine_form_a_group_as_large_as_the_model_splits():
    nodes = [NodeCapacity(n, GIB * m) for n, m in (("a", 8), ("b", 8), ("c", 8), ("d", 4))]
    engines = {"a": "torch", "b": "torch", "c": "torch", "d": "mlx"}
    assert tensor_groups(nodes, engines, (2, 3)) == [("a", "b", "c"), ("d",)]
    assert tensor_groups(nodes, engines, (2, 4)) == [("a", "b"), ("c",), ("d",)]  # 3 does not split: 2 + 1
    assert tensor_groups(nodes, engines, ()) == [("a",), ("b",), ("c",), ("d",)]


def test_layers_split_over_groups_by_the_memory_every_rank_offers():
    nodes = [NodeCapacity("a", 8 * GIB), NodeCapacity("b", 6 * GIB), NodeCapacity("c", 12 * GIB)]
    stages = tensor_stages(8, nodes, {"a": "torch", "b": "torch", "c": "mlx"}, (2,))
    # the group (a, b) offers 2 x 6 GiB, c 12 GiB: half the layers each (ring order: memory, then node id)
    assert stages == [Stage("a", 0, 4, ("b",)), Stage("c", 4, 8)]
    nodes[2] = NodeCapacity("c", 36 * GIB)
    assert tensor_stages(8, nodes, {"a": "torch", "b": "torch", "c": "mlx"}, (2,)) == \
        [Stage("c", 0, 6), Stage("a", 6, 8, ("b",))]


def test_a_member_holds_its_ranks_slice_and_only_the_leader_the_ends():
    plan = Plan("m", 8, (Stage("c", 0, 4), Stage("a", 4, 8, ("b",))), (("a", 8 * GIB), ("b", 6 * GIB),
                                                                       ("c", 12 * GIB)))
    assert plan.node_ids == ["c", "a"] and plan.member_ids == ["c", "a", "b"]
    assert plan.shard_for("a") == Shard("m", 4, 8, 8, TensorSplit(0, 2)) and plan.shard_for("a").is_last
    assert plan.shard_for("b") == Shard("m", 4, 8, 8, TensorSplit(1, 2)) and not plan.shard_for("b").is_last
    assert plan.stage_index("b") is None and plan.group_of("b") == plan.stages[1] and plan.group_of("c") is None
    assert plan.to_json()["stages"][1]["group"] == ["a", "b"]
    assert plan.digest != Plan("m", 8, (Stage("c", 0, 4), Stage("a", 4, 8)), plan.memories).digest
    # each rank needs half the group's layers; the leader also the head
    assert FOOTPRINT.shard_bytes(plan.shard_for("b")) == 2 * GIB
    assert FOOTPRINT.shard_bytes(plan.shard_for("a")) == 2 * GIB + GIB // 4
    small = Plan("m", 8, plan.stages, (("a", 8 * GIB), ("b", GIB), ("c", 12 * GIB)))
    assert fit_problems(small, FOOTPRINT, {}) == [
        f"node b needs {2 * GIB} bytes for layers [4, 8) (tp 1/2) but has {GIB} bytes available"]


def test_every_member_must_ask_for_tensor_parallelism():
    members = [Member("a", "torch", 8 * GIB), Member("b", "torch", 8 * GIB)]
    tensor = SpeedFigures(placement="memory", parallel="tensor")
    decision = Placer("a").decide("m", 8, FOOTPRINT, members, {"a": tensor, "b": tensor}, None, (2,))
    assert decision.plan.stages == (Stage("a", 0, 8, ("b",)),) and decision.report.mode == "tensor"
    decision = Placer("a").decide("m", 8, FOOTPRINT, members, {"a": tensor, "b": SpeedFigures(placement="memory")},
                                  None, (2,))
    assert all(not s.group for s in decision.plan.stages) and decision.report.mode == "memory"
    decision = Placer("a").decide("m", 8, FOOTPRINT, members, {"a": tensor, "b": tensor}, None, ())
    assert "no group forms" in decision.report.why and len(decision.plan.stages) == 2


def measured(layer_ms: float, slice_ms: float, link_us: int, peer: str, allreduce: dict[str, int] | None = None
             ) -> SpeedFigures:
    return SpeedFigures("compute", "m", int(layer_ms * 1e6), int(layer_ms * 1e5), 1.0, False,
                        rtt_us={peer: max(2048, link_us)}, link_us={peer: link_us},
                        slice_decode_ns={"2": int(slice_ms * 1e6)}, allreduce_ns=allreduce or {})


def decide(link_us: int, allreduce: dict[str, int] | None = None):
    members = [Member("a", "torch", 8 * GIB), Member("b", "torch", 8 * GIB)]
    figures = {"a": measured(10, 5.5, link_us, "b", allreduce), "b": measured(10, 5.5, link_us, "a")}
    return Placer("a").decide("m", 8, FOOTPRINT, members, figures, None, (2,))


def test_auto_takes_a_group_where_the_link_is_fast_and_the_pipeline_where_it_is_slow():
    fast = decide(link_us=64)  # a LAN: each layer 5.5 ms + 2 x (0.35 + 0.064) ms, against 10 ms
    assert fast.plan.stages == (Stage("a", 0, 8, ("b",)),) and fast.report.mode == "tensor"
    head = 2_500_000  # not split: the leader's, a quarter layer's bytes
    assert fast.report.predicted["tensor"] == 8 * (5_500_000 + 2 * (350_000 + 64_000)) + head
    slow = decide(link_us=16384)  # 5 ms each way added: every all-reduce waits a round trip
    assert all(not s.group for s in slow.plan.stages) and slow.report.mode == "compute"
    assert slow.report.predicted["tensor"] > slow.report.predicted["pipeline"]
    assert "tensor parallel" in slow.report.why


def test_a_groups_measured_all_reduce_replaces_the_estimate():
    # the group formed and found its all-reduce at 2 ms: 8 x (5.5 + 4) ms is no 10 % gain over 8 x 10 ms + hops
    decision = decide(link_us=64, allreduce={"a,b": 2_000_000})
    assert all(not s.group for s in decision.plan.stages)
    assert decision.report.predicted["tensor"] == 8 * (5_500_000 + 2 * 2_000_000) + 2_500_000
