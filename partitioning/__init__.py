"""The plan: which node runs which contiguous layer range, split by memory (ring.py) or by speed (placement.py);
the plan a cluster agrees on (plan.py), which split its members' figures call for (decision.py), and several models'
instances sharing the nodes' memory (instances.py).

May import: exo_like.models (footprints, shards) and nothing else of exo_like."""

from partitioning.placement import LeftOut, NodeSpeed, Placement, place_by_speed, speeds_equal, stage_times
from partitioning.ring import NodeCapacity, Stage, plan_ring, ring_order, split_layers

__all__ = ["LeftOut", "NodeCapacity", "NodeSpeed", "Placement", "Stage", "place_by_speed", "plan_ring", "ring_order",
           "speeds_equal", "split_layers", "stage_times"]
