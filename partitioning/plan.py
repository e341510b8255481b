"""A plan: which node runs which layers of which model, with a digest that every member must announce.

Pure data plus the fit check (the one place that decides whether a range fits a node: `needed_bytes`), used by
both placements: by memory (`make_plan`) and by speed (`make_speed_plan`). The digest covers the model, the
layer count, the stages and each member's memory, so two nodes announce the same digest only if they computed
the same ring from the same view. (Not the speed figures: a plan's ring is what must agree, and a plan whose
stages stay the same must not restart the requests on it when a figure is refined.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

from exo_like.models.footprint import ModelFootprint
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import TensorSplit
from partitioning import NodeCapacity, NodeSpeed, Placement, Stage, place_by_speed, plan_ring


@dataclass(frozen=True)
class Plan:
    model_id: str
    n_layers: int
    stages: tuple[Stage, ...]
    memories: tuple[tuple[str, int], ...]  # (node id, memory bytes) of every member the plan was made from

    @cached_property  # read on every message of every request; the plan never changes
    def digest(self) -> str:
        # (A stage's group only when it has one: plans without groups keep the digests they always had.)
        stages = [(s.node_id, s.start_layer, s.end_layer) + ((list(s.group),) if s.group else ())
                  for s in self.stages]
        body = json.dumps([self.model_id, self.n_layers, stages, self.memories])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    @property
    def node_ids(self) -> list[str]:
        """The stages' addresses on the ring, in order (a tensor-parallel stage's leader)."""
        return [s.node_id for s in self.stages]

    @property
    def member_ids(self) -> list[str]:
        """Every node the plan runs on: the stages' nodes and their groups' followers."""
        return [node_id for s in self.stages for node_id in s.members]

    def stage_index(self, node_id: str) -> int | None:
        """The stage a node leads (or is alone in); None for a follower or a node outside the plan."""
        for i, stage in enumerate(self.stages):
            if stage.node_id == node_id:
                return i
        return None

    def shard_for(self, node_id: str) -> Shard | None:
        for stage in self.stages:
            if node_id in stage.members:
                split = TensorSplit(stage.members.index(node_id), len(stage.members)) if stage.group else None
                return Shard(self.model_id, stage.start_layer, stage.end_layer, self.n_layers, split)
        return None

    def group_of(self, node_id: str) -> Stage | None:
        """The tensor-parallel stage a node is a member of (None: it runs a stage alone, or none)."""
        return next((s for s in self.stages if s.group and node_id in s.members), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "n_layers": self.n_layers,
            "digest": self.digest,
            # a tensor-parallel stage names its members, the leader first
            "stages": [{"node_id": s.node_id, "start_layer": s.start_layer, "end_layer": s.end_layer,
                        **({"group": list(s.members)} if s.group else {})} for s in self.stages],
        }


def make_plan(model_id: str, n_layers: int, members: list[NodeCapacity], layer_bytes: Sequence[int] | None = None
              ) -> Plan:
    """The memory split (partitioning/ring.py); by bytes where the layers' bytes differ."""
    stages = plan_ring(n_layers, members, layer_bytes)
    memories = tuple(sorted((m.node_id, m.memory_bytes) for m in members))
    return Plan(model_id, n_layers, tuple(stages), memories)


@dataclass(frozen=True)
class Holder:
    """How a node holds its layers: its engine, its --dtype and its device (see footprint.py)."""

    engine: str | None = None
    dtype: str | None = None
    device: str | None = None


def needed_bytes(footprint: ModelFootprint, holder: Holder, shard: Shard) -> int:
    """Bytes a node holding its layers so (engine, dtype, device) needs for the shard's parameters."""
    return footprint.held_by(holder.engine, holder.dtype, holder.device).shard_bytes(shard)


def head_ns(footprint: ModelFootprint, holder: Holder, layer_ns: int) -> int:
    """A node's time for the final norm and LM head of one decode step, from its time for a layer: decoding
    streams every weight once per token, so the head costs its bytes' worth of layer time."""
    held = footprint.held_by(holder.engine, holder.dtype, holder.device)
    head = held.head_bytes + (held.embed_bytes if held.tied else 0)  # a tied head is the embedding matrix
    layer = max(1, sum(held.layer_bytes) // max(1, len(held.layer_bytes)))
    return layer_ns * head // layer


def speed_nodes(members: list[NodeCapacity], layer_ns: dict[str, int], footprint: ModelFootprint,
                holders: dict[str, Holder]) -> list[NodeSpeed]:
    return [NodeSpeed(m.node_id, m.memory_bytes, layer_ns[m.node_id],
                      head_ns(footprint, holders.get(m.node_id, Holder()), layer_ns[m.node_id])) for m in members]


def make_speed_plan(model_id: str, n_layers: int, members: list[NodeCapacity], layer_ns: dict[str, int],
                    footprint: ModelFootprint, holders: dict[str, Holder],
                    hop_ns: Callable[[str, str], int]) -> tuple[Plan, Placement] | None:
    """The plan placed by speed (partitioning/placement.py); None when no split fits every node's memory."""
    memory = {m.node_id: m.memory_bytes for m in members}

    def fits(node_id: str, start: int, end: int) -> bool:
        shard = Shard(model_id, start, end, n_layers)
        return needed_bytes(footprint, holders.get(node_id, Holder()), shard) <= memory[node_id]

    placement = place_by_speed(n_layers, speed_nodes(members, layer_ns, footprint, holders), fits, hop_ns,
                               footprint.layer_bytes)
    if placement is None:
        return None
    memories = tuple(sorted((m.node_id, m.memory_bytes) for m in members))
    return Plan(model_id, n_layers, placement.stages, memories), placement


def fit_problems(plan: Plan, footprint: ModelFootprint, holders: dict[str, Holder]) -> list[str]:
    """One sentence per node whose range needs more memory than it offers; empty when the plan fits.

    holders: how each node holds its layers (missing: as stored)."""
    memory = dict(plan.memories)
    problems = []
    total_needed = 0
    for node_id in plan.member_ids:
        shard = plan.shard_for(node_id)
        assert shard is not None
        needed = needed_bytes(footprint, holders.get(node_id, Holder()), shard)
        total_needed += needed
        part = "" if shard.tp is None else f" ({shard.tp})"
        if needed > memory[node_id]:
            problems.append(f"node {node_id} needs {needed} bytes for layers [{shard.start_layer}, "
                            f"{shard.end_layer}){part} but has {memory[node_id]} bytes available")
    total_memory = sum(memory.values())
    if problems and total_needed > total_memory:
        problems.insert(0, f"the model needs {total_needed} bytes in total; the cluster has {total_memory} bytes")
    return problems
