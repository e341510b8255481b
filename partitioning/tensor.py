"""Tensor-parallel stages: which nodes run a stage together, each a slice of every layer of it.

A group is made of nodes of one engine (their collectives are the framework's own: torch.distributed, or
mx.distributed), in ring order, as many as the model's layers split over (`sizes`: the group sizes the model's
heads and MLPs allow, see models/tensor_split.py); nodes left over, and engines with a single node, run stages of
their own. Layers are then split over the units (groups and single nodes) as the ring splits them over nodes, by
memory: a group offers its size times its smallest member's memory (each rank holds its share of every layer).
Pure functions of what every node announced, so every node makes the same stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from partitioning.ring import NodeCapacity, Stage, plan_ring, ring_order


def tensor_groups(members: Sequence[NodeCapacity], engines: dict[str, str], sizes: Sequence[int]
                  ) -> list[tuple[str, ...]]:
    """Per engine with several members, one group of the first (ring order) `size` of them, `size` the largest
    allowed that they reach; every other member a unit of its own. Units in ring order of their first member."""
    ordered = ring_order(members)
    by_engine: dict[str, list[str]] = {}
    for member in ordered:
        by_engine.setdefault(engines.get(member.node_id, ""), []).append(member.node_id)
    units: list[tuple[str, ...]] = []
    for nodes in by_engine.values():
        size = max((n for n in sizes if 2 <= n <= len(nodes)), default=1)
        units.append(tuple(nodes[:size]))
        units.extend((node,) for node in nodes[size:])
    position = {m.node_id: i for i, m in enumerate(ordered)}
    return sorted(units, key=lambda unit: position[unit[0]])


def tensor_stages(n_layers: int, members: Sequence[NodeCapacity], engines: dict[str, str], sizes: Sequence[int],
                  layer_bytes: Sequence[int] | None = None) -> list[Stage]:
    """The stages of a plan with tensor-parallel groups (see the module's docstring)."""
    memory = {m.node_id: m.memory_bytes for m in members}
    units = {unit[0]: unit for unit in tensor_groups(members, engines, sizes)}
    capacities = [NodeCapacity(leader, len(unit) * min(memory[n] for n in unit)) for leader, unit in units.items()]
    return [Stage(s.node_id, s.start_layer, s.end_layer, units[s.node_id][1:])
            for s in plan_ring(n_layers, capacities, layer_bytes)]


# What one all-reduce of a decode step's hidden state costs before a group has measured its own: the collective
# library's fixed cost (gloo on CPU: 0.25-0.45 ms between two processes on one host, measured here; it hands each
# call between its threads) plus one link round trip per further rank (a ring all-reduce passes 2 (N - 1) messages,
# each one way). A formed group's leader measures the real figure and announces it.
ALLREDUCE_BASE_NS = 350_000


def group_key(members: Sequence[str]) -> str:
    """How a group's measured all-reduce time is announced: its members' ids in rank order."""
    return ",".join(members)


def allreduce_ns(members: Sequence[str], measured: dict[str, int], link_us: Callable[[str, str], int]) -> int:
    """One all-reduce in the group `members`: as measured, else estimated (see ALLREDUCE_BASE_NS)."""
    if group_key(members) in measured:
        return measured[group_key(members)]
    slowest = max((link_us(a, b) for a in members for b in members if a < b), default=0)
    return ALLREDUCE_BASE_NS + (len(members) - 1) * slowest * 1000


def group_layer_ns(members: Sequence[str], slice_ns: dict[str, dict[str, int]], allreduce: int) -> int | None:
    """A group's time for one layer of a decode step: its slowest member's slice, then two all-reduces. None when
    a member has not measured the slice."""
    times = [slice_ns.get(m, {}).get(str(len(members))) for m in members]
    if any(t is None for t in times):
        return None
    return max(t for t in times if t is not None) + 2 * allreduce
