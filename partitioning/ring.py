"""Ring order and layer split. Pure functions: every node computes the same plan from the same membership.

Ring order: nodes sorted by (memory descending, node id). Layers are split by the largest-remainder method,
weighted by memory, as contiguous ranges in ring order, with at least one layer per node while there are at
least as many layers as nodes. Example: 7 layers over 6, 3 and 1 GiB -> [0,4), [4,6), [6,7).

Layers of unequal bytes (a mixture of experts' dense layers among sparse ones, DeepSeek's dense first layers) are
split by bytes instead: each node's range ends where the layers' bytes so far come nearest its share of the
memory so far.
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
    """Layers [start_layer, end_layer) run by node `node_id`, or by a tensor-parallel group: `node_id` its leader
    (rank 0, the stage's address on the ring), `group` its followers in rank order."""

    node_id: str
    start_layer: int
    end_layer: int
    group: tuple[str, ...] = ()

    @property
    def layer_count(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def members(self) -> tuple[str, ...]:
        """Every node running the stage, in rank order (the leader first)."""
        return (self.node_id,) + self.group


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


def split_layer_bytes(layer_bytes: Sequence[int], memories: Sequence[int]) -> list[int]:
    """Layer counts per node (in the given order) for layers of the given bytes: node j's range ends at the
    boundary whose bytes so far come nearest to the total's share of nodes 0..j's memory (ties: the earlier
    boundary), each node keeping at least one layer while there are as many layers as nodes. Exact arithmetic."""
    n_layers, n_nodes = len(layer_bytes), len(memories)
    if n_layers < 1 or not memories:
        raise ValueError("need at least one layer and one node")
    cumulative = [0]
    for size in layer_bytes:
        cumulative.append(cumulative[-1] + size)
    total_memory = sum(memories) or n_nodes
    weights = list(memories) if sum(memories) else [1] * n_nodes
    keep = 1 if n_layers >= n_nodes else 0
    ends, start, memory_so_far = [], 0, 0
    for j, weight in enumerate(weights):
        memory_so_far += weight
        if j == n_nodes - 1:
            ends.append(n_layers)
            break
        target = Fraction(cumulative[-1] * memory_so_far, total_memory)
        low, high = start + keep, n_layers - keep * (n_nodes - j - 1)
        end = min(range(low, high + 1), key=lambda i: (abs(cumulative[i] - target), i))
        ends.append(end)
        start = end
    return [end - begin for begin, end in zip([0, *ends[:-1]], ends)]


def plan_ring(n_layers: int, nodes: Sequence[NodeCapacity], layer_bytes: Sequence[int] | None = None
              ) -> list[Stage]:
    """Contiguous stages in ring order. Nodes that get no layers (more nodes than layers) are left out.
    layer_bytes: each layer's bytes, when known; unequal ones are split by bytes (see above)."""
    ordered = ring_order(nodes)
    memories = [n.memory_bytes for n in ordered]
    if layer_bytes is not None and len(set(layer_bytes)) > 1:
        counts = split_layer_bytes(layer_bytes, memories)
    else:
        counts = split_layers(n_layers, memories)
    stages: list[Stage] = []
    start = 0
    for node, count in zip(ordered, counts):
        if count:
            stages.append(Stage(node.node_id, start, start + count))
            start += count
    return stages
