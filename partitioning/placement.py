"""Placement by speed: contiguous layer ranges that make the slowest stage of the ring as fast as possible.

A pipeline runs at the pace of its slowest stage. A stage's time per token is
    its layer count x the node's measured time for one layer (one decode step)
  + the node's time for the LM head, if it is the last stage (the head streams its bytes like a layer does)
  + the hop to the next stage of the ring (one way).
The placement minimises the largest of those (the bottleneck), then, among the splits with that bottleneck, the
sum over stages (a single request's time per token), subject to: every range fits its node's memory, ranges are
contiguous and cover every layer, and every node holds at least one layer. All figures are integers
(nanoseconds), so the arithmetic is exact and every node computes the same plan from the same figures.

Ring order is today's memory order ((memory descending, node id), see ring.py), rotated: a rotation keeps every
node's neighbours (so the hops) and only changes which node is first (holds the embedding) and which is last
(computes the LM head, several layers' worth of work on a small model). Every rotation is tried; ties go to the
smaller rotation, so the unrotated memory order wins any tie.

Equal speeds: when every node's layer time lies within EQUAL_SPEEDS of the fastest (exactly: slowest * 2 <=
fastest * 3), the nodes count as the same hardware measured with noise and the plan is today's memory split,
as long as that split fits; the split by speed would only chase noise. (Nodes of one machine measured one after
another differ by up to about 25 % here, more while other processes run: a tighter rule would re-split
identical hardware by noise.)

Leaving a node out: starting from every node (with more nodes than layers: the nodes the memory split uses), a
node is left out when the best plan without it has a strictly faster bottleneck than the best plan with it, or
when no plan fits with it and one does without it; one node at a time, the one whose absence helps most (ties:
smaller node id), for as long as that helps. Each left-out node carries the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from partitioning.ring import NodeCapacity, Stage, plan_ring, ring_order

EQUAL_SPEEDS = Fraction(3, 2)  # layer times within this ratio of each other count as equal hardware
INF = 2**60  # no split: larger than any stage time (int64 sums of two stay exact)
MAX_FIGURE_NS = 10**12  # figures are clamped here, so a stage time stays far below INF for any layer count

Fits = Callable[[str, int, int], bool]  # (node id, start layer, end layer) -> the range fits the node's memory
Hop = Callable[[str, str], int]  # (node id, next node id) -> nanoseconds one way


@dataclass(frozen=True)
class NodeSpeed:
    node_id: str
    memory_bytes: int
    layer_ns: int  # one layer, one decode step, batch 1, on this node's engine/device/dtype
    head_ns: int = 0  # the final norm and LM head, one decode step, when this node is the last stage

    def capacity(self) -> NodeCapacity:
        return NodeCapacity(self.node_id, self.memory_bytes)


@dataclass(frozen=True)
class LeftOut:
    node_id: str
    reason: str


@dataclass(frozen=True)
class Placement:
    stages: tuple[Stage, ...]
    stage_ns: tuple[int, ...]  # each stage's time per token: compute + hop
    left_out: tuple[LeftOut, ...]
    how: str  # in words: which rule made the split

    @property
    def bottleneck_ns(self) -> int:
        return max(self.stage_ns)

    @property
    def total_ns(self) -> int:
        """A single request's time per token: the sum of the stages (tokens go round the ring one at a time)."""
        return sum(self.stage_ns)

    @property
    def bottleneck(self) -> str:
        """Node id of the slowest stage (the first of equals)."""
        return self.stages[self.stage_ns.index(self.bottleneck_ns)].node_id


def speeds_equal(nodes: Sequence[NodeSpeed]) -> bool:
    times = [clamp(n.layer_ns) for n in nodes]
    return max(times) <= min(times) * EQUAL_SPEEDS


def clamp(ns: int, low: int = 1) -> int:
    """A figure within [low, MAX_FIGURE_NS] (a layer takes some time; a hop may take none)."""
    return max(low, min(int(ns), MAX_FIGURE_NS))


def stage_times(n_layers: int, stages: Sequence[Stage], nodes: Sequence[NodeSpeed], hop: Hop) -> tuple[int, ...]:
    """Time per token of each stage of a given split (for the split chosen, and to compare with others)."""
    by_id = {n.node_id: n for n in nodes}
    times = []
    for i, stage in enumerate(stages):
        node = by_id[stage.node_id]
        following = stages[(i + 1) % len(stages)].node_id
        hop_ns = clamp(hop(stage.node_id, following), 0) if len(stages) > 1 else 0
        head = clamp(node.head_ns) if stage.end_layer == n_layers and node.head_ns else 0
        times.append(stage.layer_count * clamp(node.layer_ns) + head + hop_ns)
    return tuple(times)


def place_by_speed(n_layers: int, nodes: Sequence[NodeSpeed], fits: Fits, hop: Hop,
                   layer_bytes: Sequence[int] | None = None) -> Placement | None:
    """The placement described above; None when no split fits every node's memory. layer_bytes: for the memory
    split, when the layers' bytes differ."""
    if n_layers < 1 or not nodes:
        raise ValueError("need at least one layer and one node")
    order = _in_ring_order(nodes)
    if speeds_equal(order):
        memory = _memory_split(n_layers, order, fits, hop, layer_bytes)
        if memory is not None:
            return memory
    return _Search(n_layers, order, fits, hop).run()


def _in_ring_order(nodes: Sequence[NodeSpeed]) -> list[NodeSpeed]:
    by_id = {n.node_id: n for n in nodes}
    return [by_id[c.node_id] for c in ring_order([n.capacity() for n in nodes])]


def _memory_split(n_layers: int, order: list[NodeSpeed], fits: Fits, hop: Hop,
                  layer_bytes: Sequence[int] | None) -> Placement | None:
    stages = tuple(plan_ring(n_layers, [n.capacity() for n in order], layer_bytes))
    if not all(fits(s.node_id, s.start_layer, s.end_layer) for s in stages):
        return None
    used = {s.node_id for s in stages}
    left = tuple(LeftOut(n.node_id, _more_nodes_than_layers(n_layers, len(order))) for n in order
                 if n.node_id not in used)
    return Placement(stages, stage_times(n_layers, stages, order, hop), left,
                     f"speeds within {_percent(EQUAL_SPEEDS)} of each other: the memory split")


def _more_nodes_than_layers(n_layers: int, n_nodes: int) -> str:
    return f"more nodes than layers ({n_nodes} nodes, {n_layers} layers): the memory split gives it none"


def _percent(ratio: Fraction) -> str:
    return f"{round((ratio - 1) * 100)} %"


@dataclass(frozen=True)
class _Split:
    key: tuple[int, int, int]  # (bottleneck, total, rotation): smaller is better
    stages: tuple[Stage, ...]
    stage_ns: tuple[int, ...]


class _Search:
    """The exact split for each candidate set of nodes and rotation, and the leaving-out loop around it."""

    def __init__(self, n_layers: int, order: list[NodeSpeed], fits: Fits, hop: Hop):
        self.n_layers, self.order, self.hop = n_layers, order, hop
        self.allowed = {n.node_id: _fit_table(n.node_id, n_layers, fits) for n in order}
        span = np.arange(n_layers + 1)
        self.counts = span[None, :] - span[:, None]  # [start, end] -> layers in the range (end - start)

    def run(self) -> Placement | None:
        members = list(self.order)
        left: list[LeftOut] = []
        if len(members) > self.n_layers:  # start where the memory split would: its nodes
            used = {s.node_id for s in plan_ring(self.n_layers, [n.capacity() for n in members])}
            reason = _more_nodes_than_layers(self.n_layers, len(members))
            left = [LeftOut(n.node_id, reason) for n in members if n.node_id not in used]
            members = [n for n in members if n.node_id in used]
        best = self.best(members)
        while len(members) > 1:
            trials = [(split.key, node.node_id, node, split) for node in members
                      if (split := self.best([m for m in members if m is not node])) is not None]
            if not trials:
                break
            key, _, node, split = min(trials, key=lambda t: (t[0], t[1]))
            if best is not None and key[0] >= best.key[0]:
                break
            left.append(LeftOut(node.node_id, _why_left_out(best, split)))
            members.remove(node)
            best = split
        if best is None:
            return None
        how = "split by measured speed: the slowest stage as fast as it can be"
        return Placement(best.stages, best.stage_ns, tuple(left), how)

    def best(self, members: list[NodeSpeed]) -> _Split | None:
        """The best split over every rotation of these nodes (in ring order), or None if none fits."""
        splits = [self.split(members[r:] + members[:r], r) for r in range(len(members))]
        found = [s for s in splits if s is not None]
        return min(found, key=lambda s: s.key) if found else None

    def split(self, order: list[NodeSpeed], rotation: int) -> _Split | None:
        """Exact minimax split of the layers over `order` (each node one contiguous range, at least one layer),
        ties broken by the smaller sum, then by giving earlier stages more layers. Dynamic programming over
        (stage, boundary) with int64 arrays: O(stages x layers^2), exact."""
        n, k = self.n_layers, len(order)
        if k > n:
            return None
        times = [self._times(node, i == k - 1, self._hop(order, i)) for i, node in enumerate(order)]
        # Bottleneck: reach[e] = the smallest possible slowest stage so far with the stages so far covering [0, e).
        reach = np.full(n + 1, INF, dtype=np.int64)
        reach[0] = 0
        for stage_times in times:
            reach = np.maximum(reach[:, None], stage_times).min(axis=0)
        bottleneck = int(reach[n])
        if bottleneck >= INF:
            return None
        # Sum: rest[i][s] = the smallest sum of stages i.. covering [s, n), each at most the bottleneck.
        capped = [np.where(t <= bottleneck, t, INF) for t in times]
        rest = [np.full(n + 1, INF, dtype=np.int64) for _ in range(k + 1)]
        rest[k][n] = 0
        for i in range(k - 1, -1, -1):
            rest[i] = np.minimum(capped[i] + rest[i + 1][None, :], INF).min(axis=1)
        stages, stage_ns, start = [], [], 0
        for i, node in enumerate(order):
            row = np.minimum(capped[i][start] + rest[i + 1], INF)
            end = int(np.flatnonzero(row == rest[i][start])[-1])  # the most layers among equals
            stages.append(Stage(node.node_id, start, end))
            stage_ns.append(int(capped[i][start, end]))
            start = end
        return _Split((bottleneck, int(rest[0][0]), rotation), tuple(stages), tuple(stage_ns))

    def _hop(self, order: list[NodeSpeed], i: int) -> int:
        return clamp(self.hop(order[i].node_id, order[(i + 1) % len(order)].node_id), 0) if len(order) > 1 else 0

    def _times(self, node: NodeSpeed, last: bool, hop_ns: int) -> np.ndarray:
        """[start, end] -> the stage's time per token for that range, INF where it is no range (end <= start),
        does not fit, or cannot be this stage's (the last stage ends at the last layer, others before it)."""
        times = self.counts * clamp(node.layer_ns) + hop_ns
        if last and node.head_ns:
            times[:, self.n_layers] += clamp(node.head_ns)
        ok = (self.counts >= 1) & self.allowed[node.node_id]
        if last:
            ok[:, : self.n_layers] = False
        else:
            ok[:, self.n_layers] = False
        return np.where(ok, times, INF).astype(np.int64)


def _fit_table(node_id: str, n_layers: int, fits: Fits) -> np.ndarray:
    """[start, end] -> whether [start, end) fits the node. More layers never take fewer bytes, so for each start
    the ranges that fit, up to the one before the last layer, are a prefix: a binary search finds its end. A
    range ending at the last layer also holds the LM head: asked on its own."""
    table = np.zeros((n_layers + 1, n_layers + 1), dtype=bool)
    for start in range(n_layers):
        low, high = start, n_layers - 1  # the largest end in (start, n_layers) that fits; start if none
        while low < high:
            middle = (low + high + 1) // 2
            if fits(node_id, start, middle):
                low = middle
            else:
                high = middle - 1
        table[start, start + 1: low + 1] = True
        table[start, n_layers] = fits(node_id, start, n_layers)
    return table


def _why_left_out(with_it: _Split | None, without: _Split) -> str:
    if with_it is None:
        return "no split with it fits every node's memory; without it one does"
    return (f"with it the slowest stage takes {with_it.key[0] / 1e6:.2f} ms per token, without it "
            f"{without.key[0] / 1e6:.2f} ms")
