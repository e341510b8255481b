"""Property tests of the ring arithmetic: contiguous, complete, proportional, order-independent."""

from __future__ import annotations

import random
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from partitioning import NodeCapacity, plan_ring, split_layers
from partitioning.ring import split_layer_bytes

GIB = 1 << 30

memories = st.lists(st.integers(1, 512 * GIB), min_size=1, max_size=12)


def nodes_from(memory_list: list[int]) -> list[NodeCapacity]:
    return [NodeCapacity(f"node-{i:02d}", m) for i, m in enumerate(memory_list)]


def test_issue_example_seven_layers_over_6_3_1_gib() -> None:
    nodes = [NodeCapacity("c", 1 * GIB), NodeCapacity("a", 6 * GIB), NodeCapacity("b", 3 * GIB)]
    assert [(s.node_id, s.start_layer, s.end_layer) for s in plan_ring(7, nodes)] == [
        ("a", 0, 4), ("b", 4, 6), ("c", 6, 7)
    ]


def test_equal_memory_orders_by_node_id() -> None:
    stages = plan_ring(4, [NodeCapacity("z", GIB), NodeCapacity("m", GIB)])
    assert [s.node_id for s in stages] == ["m", "z"]


@settings(max_examples=300, deadline=None)
@given(n_layers=st.integers(1, 200), memory_list=memories)
def test_ranges_contiguous_and_cover_all_layers(n_layers: int, memory_list: list[int]) -> None:
    stages = plan_ring(n_layers, nodes_from(memory_list))
    assert stages[0].start_layer == 0 and stages[-1].end_layer == n_layers
    for before, after in zip(stages, stages[1:]):
        assert before.end_layer == after.start_layer
    assert all(s.layer_count >= 1 for s in stages)
    if n_layers >= len(memory_list):
        assert len(stages) == len(memory_list)


@settings(max_examples=300, deadline=None)
@given(n_layers=st.integers(1, 200), memory_list=memories)
def test_proportional_within_one_layer(n_layers: int, memory_list: list[int]) -> None:
    counts = split_layers(n_layers, memory_list)
    total = sum(memory_list)
    quotas = [Fraction(n_layers * m, total) for m in memory_list]
    assert sum(counts) == n_layers
    if all(q >= 1 for q in quotas) or n_layers < len(memory_list):
        # No node needed the at-least-one-layer rule: pure largest remainder.
        assert all(abs(c - q) < 1 for c, q in zip(counts, quotas))
    else:
        # The at-least-one-layer rule binds: nodes below one layer's worth get exactly one, paid for by nodes
        # that then hold fewer than their quota; nobody ends above the ceiling of its quota.
        for count, quota in zip(counts, quotas):
            assert count == 1 if quota < 1 else 1 <= count <= -(-quota // 1)


@settings(max_examples=200, deadline=None)
@given(n_layers=st.integers(1, 200), memory_list=memories, seed=st.integers(0, 1000))
def test_deterministic_under_node_reordering(n_layers: int, memory_list: list[int], seed: int) -> None:
    nodes = nodes_from(memory_list)
    shuffled = nodes[:]
    random.Random(seed).shuffle(shuffled)
    assert plan_ring(n_layers, nodes) == plan_ring(n_layers, shuffled)


@settings(max_examples=200, deadline=None)
@given(n_layers=st.integers(1, 200), memory_list=memories)
def test_more_memory_never_means_fewer_layers(n_layers: int, memory_list: list[int]) -> None:
    counts = split_layers(n_layers, sorted(memory_list, reverse=True))
    assert all(a >= b for a, b in zip(counts, counts[1:]))


def test_layers_of_unequal_bytes_are_split_by_bytes() -> None:
    """DeepSeek's shape: three dense layers of 1 unit, then mixture layers of 10 (153 units). Two equal nodes split
    the bytes, not the layers: the first takes 3 + 7 layers, 73 units against 80, the boundary nearest half (counts
    alone would give 9 + 9 layers: 63 units against 90)."""
    layer_bytes = [1, 1, 1] + [10] * 15
    stages = plan_ring(18, [NodeCapacity("a", GIB), NodeCapacity("b", GIB)], layer_bytes)
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 10), (10, 18)]
    assert plan_ring(18, [NodeCapacity("a", GIB), NodeCapacity("b", GIB)], [10] * 18) == \
        plan_ring(18, [NodeCapacity("a", GIB), NodeCapacity("b", GIB)])  # equal bytes: the count split


@settings(max_examples=300, deadline=None)
@given(layer_bytes=st.lists(st.integers(1, 1000), min_size=1, max_size=60), memory_list=memories)
def test_a_byte_split_is_contiguous_and_each_boundary_nearest_its_share(layer_bytes: list[int],
                                                                        memory_list: list[int]) -> None:
    counts = split_layer_bytes(layer_bytes, memory_list)
    assert sum(counts) == len(layer_bytes) and len(counts) == len(memory_list)
    if len(layer_bytes) >= len(memory_list):
        assert all(c >= 1 for c in counts)
    # Each boundary is the nearest one to its share among those leaving every node a layer.
    cumulative = [sum(layer_bytes[:i]) for i in range(len(layer_bytes) + 1)]
    ends = [sum(counts[:j + 1]) for j in range(len(counts))]
    keep = 1 if len(layer_bytes) >= len(memory_list) else 0
    for j, end in enumerate(ends[:-1]):
        target = Fraction(cumulative[-1] * sum(memory_list[:j + 1]), sum(memory_list))
        low = (ends[j - 1] if j else 0) + keep
        high = len(layer_bytes) - keep * (len(memory_list) - j - 1)
        assert all(abs(cumulative[end] - target) <= abs(cumulative[i] - target) for i in range(low, high + 1))


def reference_split(n_layers: int, memories: list[int]) -> list[int]:
    """The rule as ring.py's docstrings and docs/placement.md state it, written apart from split_layers (integers
    scaled by the total memory instead of fractions, a plain loop instead of sorting by remainder):

    - node i's quota is n_layers * memory_i / total (equal weights when no node has memory);
    - each node gets its quota rounded down, and the layers left go one each to the largest remainders, ties to
      the earlier ring position;
    - while there are at least as many layers as nodes, each node left with none gets one layer from the node most
      over its quota (count - quota) among those that keep at least one, ties to the later ring position."""
    weights = memories if sum(memories) > 0 else [1] * len(memories)
    total = sum(weights)
    scaled = [n_layers * w for w in weights]  # quota_i * total
    counts = [s // total for s in scaled]
    remainders = [s % total for s in scaled]
    for _ in range(n_layers - sum(counts)):
        best = None
        for i, remainder in enumerate(remainders):
            if remainder >= 0 and (best is None or remainder > remainders[best]):
                best = i
        counts[best] += 1
        remainders[best] = -1  # (a node gets at most one of the layers left)
    if n_layers >= len(counts):
        for empty in range(len(counts)):
            if counts[empty]:
                continue
            donor = None
            for i in range(len(counts)):
                over = counts[i] * total - scaled[i]  # (count - quota) * total
                if counts[i] >= 2 and (donor is None or over >= counts[donor] * total - scaled[donor]):
                    donor = i
            counts[donor] -= 1
            counts[empty] = 1
    return counts


def random_cluster(rng: random.Random) -> tuple[int, list[int]]:
    """A few nodes, mostly of very different memory (so some get no layer by their quota alone), some equal (ties),
    a few with none, and at least as many layers as nodes."""
    n_nodes = rng.randint(2, 9)
    sizes = [0, 1, 2, 3, 4, 6, 8, 16, 24, 32, 64, 128, 256, 512]
    memories = [rng.choice(sizes) * GIB + rng.choice([0, 0, rng.randint(0, GIB)]) for _ in range(n_nodes)]
    return rng.randint(n_nodes, 4 * n_nodes + 6), memories


def test_the_split_is_the_documented_rule_over_many_random_clusters() -> None:
    """split_layers and plan_ring against reference_split on 4000 seeded random clusters. The clusters where the
    rule's choice of donor matters are counted, so the comparison cannot pass for want of them: an empty node
    whose donor by the rule (most over its quota) is not the node with the most layers, nor the first or last
    node with two or more."""
    rng = random.Random(20261128)
    topped_up = telling = 0
    for _ in range(4000):
        n_layers, memories = random_cluster(rng)
        ordered = sorted(memories, reverse=True)  # ring order (equal memories go by node id: no count changes)
        expected = reference_split(n_layers, ordered)
        assert split_layers(n_layers, ordered) == expected, (n_layers, ordered)
        nodes = nodes_from(memories)
        stages = plan_ring(n_layers, nodes)
        by_node = {n.node_id: n.memory_bytes for n in nodes}
        assert [by_node[s.node_id] for s in stages] == ordered
        assert [s.layer_count for s in stages] == expected, (n_layers, ordered)
        # How much the comparison can tell: the donors the rule picks against the obvious other choices.
        weights = ordered if sum(ordered) else [1] * len(ordered)
        quotas = [Fraction(n_layers * w, sum(weights)) for w in weights]
        counts = [int(q) for q in quotas]
        for i in sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))[: n_layers - sum(counts)]:
            counts[i] += 1
        if 0 in counts:
            topped_up += 1
            donors = [i for i, c in enumerate(counts) if c >= 2]
            by_rule = max(donors, key=lambda i: (counts[i] - quotas[i], i))
            most_layers = max(donors, key=lambda i: (counts[i], i))
            telling += by_rule not in (most_layers, donors[0], donors[-1])
    assert topped_up > 1000 and telling > 100, (topped_up, telling)
