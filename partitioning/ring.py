"""Ring order and layer split. Pure functions: every node computes the same plan from the same membership.

Ring order: nodes sorted by (memory descending, node id). Layers are split by the largest-remainder method,
weighted by memory, as contiguous ranges in ring order, with at least one layer per node while there are at
least as many layers as nodes. Example: 7 layers over 6, 3 and 1 GiB -> [0,4), [4,6), [6,7).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_bytes: int


@dataclass(frozen=True)
class Stage:
    node_id: str
    start_layer: int
    end_layer: int

    @property
    def layer_count(self) -> int:
        return self.end_layer - self.start_layer


def ring_order(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    return sorted(nodes, key=lambda n: (-n.memory_bytes, n.node_id))


def split_layers(n_layers: int, memories: Sequence[int]) -> list[int]:
    """Layer counts per node (in the given order), proportional to memory by largest remainder.

    Exact rational arithmetic, so every node gets the same answer whatever its float rounding.
    """
    if n_layers < 1 or not memories:
        raise ValueError("need at least one layer and one node")
    if any(m < 0 for m in memories):
        raise ValueError("memory cannot be negative")
    total = sum(memories)
    weights = list(memories) if total > 0 else [1] * len(memories)
    total = sum(weights)
    quotas = [Fraction(n_layers * w, total) for w in weights]
    counts = [int(q) for q in quotas]
    # Hand out the layers left by rounding down, largest remainder first; ties go to the earlier ring position.
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: n_layers - sum(counts)]:
        counts[i] += 1
    if n_layers >= len(counts):
        _give_every_node_a_layer(counts, quotas)
    return counts


def _give_every_node_a_layer(counts: list[int], quotas: list[Fraction]) -> None:
    """Move single layers to empty nodes from the node most over its quota (that keeps at least one)."""
    for empty in [i for i, c in enumerate(counts) if c == 0]:
        donors = [i for i, c in enumerate(counts) if c >= 2]
        # Ties go to the later ring position, so layer counts stay non-increasing along the ring.
        donor = max(donors, key=lambda i: (counts[i] - quotas[i], i))
        counts[donor] -= 1
        counts[empty] = 1


def plan_ring(n_layers: int, nodes: Sequence[NodeCapacity]) -> list[Stage]:
    """Contiguous stages in ring order. Nodes that get no layers (more nodes than layers) are left out."""
    ordered = ring_order(nodes)
    counts = split_layers(n_layers, [n.memory_bytes for n in ordered])
    stages: list[Stage] = []
    start = 0
    for node, count in zip(ordered, counts):
        if count:
            stages.append(Stage(node.node_id, start, start + count))
            start += count
    return stages
