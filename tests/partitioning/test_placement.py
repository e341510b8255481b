"""Placement by speed (partitioning/placement.py): property tests against the memory split and brute force."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from partitioning import NodeCapacity, NodeSpeed, Stage, place_by_speed, plan_ring, speeds_equal, stage_times
from partitioning.placement import _Search

MS = 1_000_000  # nanoseconds


@dataclass(frozen=True)
class Figures:
    """One generated cluster: per-layer bytes, embedding and head bytes, nodes and their links."""

    n_layers: int
    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    nodes: tuple[NodeSpeed, ...]
    hops: dict[frozenset[str], int]

    def fits(self, node_id: str, start: int, end: int) -> bool:
        memory = next(n.memory_bytes for n in self.nodes if n.node_id == node_id)
        needed = sum(self.layer_bytes[start:end]) + (self.embed_bytes if start == 0 else 0) + \
            (self.head_bytes if end == self.n_layers else 0)
        return needed <= memory

    def hop(self, a: str, b: str) -> int:
        return self.hops[frozenset((a, b))]

    def memory_split(self) -> list[Stage]:
        return plan_ring(self.n_layers, [NodeCapacity(n.node_id, n.memory_bytes) for n in self.nodes])

    def memory_split_fits(self) -> bool:
        return all(self.fits(s.node_id, s.start_layer, s.end_layer) for s in self.memory_split())


@st.composite
def figures(draw: st.DrawFn, equal: bool = False, max_nodes: int = 6, max_layers: int = 40) -> Figures:
    n_layers = draw(st.integers(1, max_layers))
    layer = draw(st.integers(1, 1000))
    layer_bytes = tuple(layer + draw(st.integers(0, layer // 4)) for _ in range(n_layers))  # mixed quant types
    embed, head = draw(st.integers(0, 5000)), draw(st.integers(0, 5000))
    total = sum(layer_bytes) + embed + head
    count = draw(st.integers(1, max_nodes))
    base = draw(st.integers(1_000, 10 * MS))
    nodes = []
    for i in range(count):
        # Equal: the same hardware measured with noise (within the 50 % that counts as equal).
        speed = base + draw(st.integers(0, base // 4)) if equal else draw(st.integers(1_000, 10 * MS))
        memory = draw(st.integers(total // max(1, count), 2 * total) | st.integers(1, 2 * total))
        head_ns = speed * head // max(1, layer)
        nodes.append(NodeSpeed(f"n{i:02d}", memory, speed, head_ns))
    ids = [n.node_id for n in nodes]
    hops = {frozenset(pair): draw(st.integers(0, MS)) for pair in itertools.combinations(ids, 2)}
    return Figures(n_layers, layer_bytes, embed, head, tuple(nodes), hops)


def place(f: Figures, nodes: tuple[NodeSpeed, ...] | list[NodeSpeed] | None = None):  # type: ignore[no-untyped-def]
    return place_by_speed(f.n_layers, list(nodes if nodes is not None else f.nodes), f.fits, f.hop)


@settings(max_examples=300, deadline=None)
@given(f=figures())
def test_ranges_are_contiguous_cover_every_layer_and_fit(f: Figures) -> None:
    placement = place(f)
    if placement is None:
        assert not f.memory_split_fits()  # the memory split fitting is one split that fits
        return
    stages = placement.stages
    assert stages[0].start_layer == 0 and stages[-1].end_layer == f.n_layers
    assert all(a.end_layer == b.start_layer for a, b in zip(stages, stages[1:]))
    assert all(s.layer_count >= 1 for s in stages)
    assert all(f.fits(s.node_id, s.start_layer, s.end_layer) for s in stages)
    used = {s.node_id for s in stages}
    assert used | {x.node_id for x in placement.left_out} == {n.node_id for n in f.nodes}
    assert not used & {x.node_id for x in placement.left_out}
    if f.n_layers >= len(f.nodes) and not placement.left_out:
        assert len(stages) == len(f.nodes)
    assert placement.stage_ns == stage_times(f.n_layers, stages, f.nodes, f.hop)


@settings(max_examples=300, deadline=None)
@given(f=figures())
def test_the_bottleneck_is_never_slower_than_the_memory_split_s(f: Figures) -> None:
    if not f.memory_split_fits():
        return
    placement = place(f)
    assert placement is not None
    memory = stage_times(f.n_layers, f.memory_split(), f.nodes, f.hop)
    assert placement.bottleneck_ns <= max(memory)


@settings(max_examples=200, deadline=None)
@given(f=figures(), seed=st.integers(0, 1000))
def test_deterministic_under_node_reordering(f: Figures, seed: int) -> None:
    shuffled = list(f.nodes)
    random.Random(seed).shuffle(shuffled)
    assert place(f) == place(f, shuffled)


@settings(max_examples=300, deadline=None)
@given(f=figures(equal=True))
def test_equal_speeds_give_today_s_memory_split(f: Figures) -> None:
    assert speeds_equal(f.nodes)
    placement = place(f)
    if f.memory_split_fits():
        assert placement is not None and list(placement.stages) == f.memory_split()
        assert "memory split" in placement.how


def brute_force(f: Figures, members: list[NodeSpeed]) -> tuple[int, int] | None:
    """(bottleneck, sum) of the best split over every rotation and every composition: what the DP must find."""
    best = None
    k = len(members)
    for r in range(k):
        order = members[r:] + members[:r]
        for cuts in itertools.combinations(range(1, f.n_layers), k - 1):
            bounds = (0, *cuts, f.n_layers)
            stages = [Stage(n.node_id, bounds[i], bounds[i + 1]) for i, n in enumerate(order)]
            if not all(f.fits(s.node_id, s.start_layer, s.end_layer) for s in stages):
                continue
            times = stage_times(f.n_layers, stages, f.nodes, f.hop)
            key = (max(times), sum(times))
            best = key if best is None or key < best else best
    return best


@settings(max_examples=300, deadline=None)
@given(f=figures(max_nodes=4, max_layers=9))
def test_the_split_is_the_exact_optimum(f: Figures) -> None:
    search = _Search(f.n_layers, sorted(f.nodes, key=lambda n: (-n.memory_bytes, n.node_id)), f.fits, f.hop)
    members = list(search.order)
    found = search.best(members)
    expected = brute_force(f, members)
    assert (None if found is None else found.key[:2]) == expected


def test_a_node_four_times_slower_gets_fewer_layers_and_the_ring_is_faster() -> None:
    nodes = [NodeSpeed("a", 8 << 30, 2 * MS), NodeSpeed("b", 8 << 30, 8 * MS), NodeSpeed("c", 8 << 30, 2 * MS)]
    placement = place_by_speed(24, nodes, lambda *_: True, lambda a, b: 100_000)
    assert placement is not None
    layers = {s.node_id: s.layer_count for s in placement.stages}
    assert layers["b"] < layers["a"] and layers["b"] < layers["c"] and sum(layers.values()) == 24
    memory = stage_times(24, plan_ring(24, [n.capacity() for n in nodes]), nodes, lambda a, b: 100_000)
    assert max(memory) == 8 * 8 * MS + 100_000
    assert placement.bottleneck_ns <= max(memory) * 2 // 3
    assert placement.left_out == ()


def test_the_lm_head_moves_to_a_fast_node() -> None:
    """The slow node would be last in memory order (smallest memory): a rotation gives the head to a fast one."""
    nodes = [NodeSpeed("a", 9 << 30, MS, 9 * MS), NodeSpeed("b", 8 << 30, MS, 9 * MS),
             NodeSpeed("c", 7 << 30, 4 * MS, 36 * MS)]
    placement = place_by_speed(24, nodes, lambda *_: True, lambda a, b: 0)
    assert placement is not None and placement.stages[-1].node_id != "c"
    assert [s.node_id for s in placement.stages] in (["b", "c", "a"], ["c", "a", "b"])  # neighbours kept


def test_a_node_that_only_slows_the_ring_is_left_out_with_the_reason() -> None:
    nodes = [NodeSpeed("fast", 8 << 30, MS), NodeSpeed("slow", 8 << 30, 100 * MS)]
    placement = place_by_speed(4, nodes, lambda *_: True, lambda a, b: 0)
    assert placement is not None
    assert [(s.node_id, s.start_layer, s.end_layer) for s in placement.stages] == [("fast", 0, 4)]
    (left,) = placement.left_out
    assert left.node_id == "slow"
    assert left.reason == "with it the slowest stage takes 100.00 ms per token, without it 4.00 ms"


def test_a_node_that_helps_is_kept_even_when_slower() -> None:
    nodes = [NodeSpeed("fast", 8 << 30, MS), NodeSpeed("slow", 8 << 30, 2 * MS)]
    placement = place_by_speed(12, nodes, lambda *_: True, lambda a, b: 0)
    assert placement is not None and placement.left_out == ()
    assert {s.node_id: s.layer_count for s in placement.stages} == {"fast": 8, "slow": 4}
    assert placement.bottleneck_ns == 8 * MS and placement.bottleneck in ("fast", "slow")


def test_a_node_whose_memory_holds_no_range_is_left_out_when_the_rest_fit() -> None:
    nodes = [NodeSpeed("big", 8 << 30, MS), NodeSpeed("tiny", 10, 2 * MS)]
    placement = place_by_speed(6, nodes, lambda node, s, e: node == "big", lambda a, b: 0)
    assert placement is not None and [s.node_id for s in placement.stages] == ["big"]
    assert placement.left_out[0].reason == "no split with it fits every node's memory; without it one does"


def test_a_slow_hop_counts() -> None:
    """Two nodes behind a slow link: the faster one alone beats the ring."""
    nodes = [NodeSpeed("a", 8 << 30, MS), NodeSpeed("b", 8 << 30, 2 * MS)]
    placement = place_by_speed(4, nodes, lambda *_: True, lambda a, b: 50 * MS)
    assert placement is not None and [s.node_id for s in placement.stages] == ["a"]
    assert placement.total_ns == 4 * MS
