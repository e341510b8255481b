"""The ring: which node runs which contiguous layer range, split by memory (ring.py) or by speed (placement.py)."""

from partitioning.placement import LeftOut, NodeSpeed, Placement, place_by_speed, speeds_equal, stage_times
from partitioning.ring import NodeCapacity, Stage, plan_ring, ring_order, split_layers

__all__ = ["LeftOut", "NodeCapacity", "NodeSpeed", "Placement", "Stage", "place_by_speed", "plan_ring", "ring_order",
           "speeds_equal", "split_layers", "stage_times"]
