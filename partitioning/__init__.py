"""The memory-weighted ring: which node runs which contiguous layer range, and whether the model fits."""

from partitioning.ring import NodeCapacity, Stage, plan_ring, ring_order, split_layers

__all__ = ["NodeCapacity", "Stage", "plan_ring", "ring_order", "split_layers"]
