"""Several models at once: which nodes each instance runs on, the memory its plan takes from them, and which idle
instances to unload so that a model that does not fit beside the others does.

Every node computes this from the same replicated inputs (the instances asked for, in the order they were asked,
the members and their announced figures), so all arrive at the same instances without a coordinator. Instances are
placed oldest first: one asked for later never moves an earlier one, it takes the memory the earlier ones left.
A node's offered memory (its --memory-gb, or what was free at start) is shared between the instances it holds.

An instance runs on the nodes the user chose, or on every member with memory left, ranked fastest first where
all have measured the model (else by the memory left to them); the planner (decision.py) splits it over them as
it splits one model today, and placement by speed leaves out the nodes whose hop costs more than their layers
save.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from exo_like.models.footprint import ModelFootprint
from partitioning.decision import Decision, Member
from partitioning.plan import Holder, Plan, needed_bytes
from partitioning.speed_figures import SpeedFigures


@dataclass(frozen=True)
class InstanceAsk:
    """A model the cluster is asked to serve, as placement needs it."""

    model: str
    n_layers: int
    footprint: ModelFootprint
    nodes: tuple[str, ...] = ()  # the nodes the user chose for it (empty: placement chooses)
    tensor_sizes: tuple[int, ...] = ()
    tensor_engines: tuple[str, ...] = ("torch", "mlx")
    instance: str = ""  # which instance of the model (several may serve one model, each on its own nodes)

    @property
    def key(self) -> str:
        return self.instance or self.model


@dataclass(frozen=True)
class Offered:
    """A member as one instance's placement sees it: its memory is what the instances placed before left."""

    node_id: str
    name: str
    engine: str
    device: str
    dtype: str | None
    memory_bytes: int


# Each member's announced figures (None: none yet), by node id; and those of each model, by model.
NodeFigures = Mapping[str, SpeedFigures | None]
Figures = Mapping[str, NodeFigures]
# What decides one instance's plan over some members from their figures: decision.Placer.decide with the ask's fields.
Decide = Callable[[InstanceAsk, list[Member], NodeFigures], Decision]


def held_bytes(plan: Plan, footprint: ModelFootprint, members: Sequence[Member]) -> dict[str, int]:
    """The bytes each node of `plan` holds for its part of the model."""
    holders = {m.node_id: Holder(m.engine, m.dtype, m.device) for m in members}
    return {node_id: needed_bytes(footprint, holders.get(node_id, Holder()), shard)
            for node_id in plan.member_ids if (shard := plan.shard_for(node_id)) is not None}


def ranked(ask: InstanceAsk, members: Sequence[Member], figures: NodeFigures) -> list[Member]:
    """The members an instance may run on, in the order placement takes them: the chosen ones if any (in the order
    given), else every member with memory left, fastest first where all have measured the model, else the most
    memory first (ties by node id, so every node ranks alike)."""
    if ask.nodes:
        by_id = {m.node_id: m for m in members}
        return [by_id[n] for n in ask.nodes if n in by_id]
    free = [m for m in members if m.memory_bytes > 0]
    speeds = {m.node_id: f.decode_ns for m in free
              if (f := figures.get(m.node_id)) is not None and f.measured_for(ask.model)}
    if len(speeds) == len(free):
        return sorted(free, key=lambda m: (speeds[m.node_id], -m.memory_bytes, m.node_id))
    return sorted(free, key=lambda m: (-m.memory_bytes, m.node_id))


def place_one(ask: InstanceAsk, members: Sequence[Member], figures: NodeFigures, decide: Decide) -> Decision:
    """The plan of one instance over the ranked members (the planner leaves out those that do not pay: placement by
    speed weighs each hop against the layers a node would take)."""
    order = ranked(ask, members, figures)
    if not order:
        chosen = ", ".join(ask.nodes)
        raise NoRoom(f"none of the chosen nodes ({chosen}) is a member" if ask.nodes else "no node has memory left")
    return decide(ask, order, figures)


class NoRoom(Exception):
    """No member can take any part of an instance."""


@dataclass(frozen=True)
class Placed:
    """An instance's decision, or why it has none (a model that does not fit beside the ones placed before it), and
    the cluster's members and their figures for the model when it was decided."""

    ask: InstanceAsk
    decision: Decision | None
    problem: str | None
    members: frozenset[str] = frozenset()
    figures: tuple[tuple[str, SpeedFigures | None], ...] = ()

    @property
    def plan(self) -> Plan | None:
        return self.decision.plan if self.decision is not None and self.decision.problem is None else None


def place_instances(asks: Sequence[InstanceAsk], members: Sequence[Member], figures: Figures, decide: Decide,
                    current: Mapping[str, Placed] | None = None) -> dict[str, Placed]:
    """Each asked instance's placement, oldest first, each on the memory the ones before it left.

    An instance placed before (`current`) keeps its plan while the members and their figures are the same and its
    nodes still have the memory for it: loading or unloading another model does not move it (its requests would
    replay)."""
    left = {m.node_id: m.memory_bytes for m in members}
    ids = frozenset(left)
    placed: dict[str, Placed] = {}
    for ask in asks:
        before = (current or {}).get(ask.key)
        seen = tuple(sorted((figures.get(ask.model) or {}).items()))
        if before is not None and before.plan is not None and before.members == ids \
                and _same_ask(before.ask, ask) and before.figures == seen:
            used = held_bytes(before.plan, ask.footprint, members)
            if all(left[node_id] >= need for node_id, need in used.items()):
                placed[ask.key] = before
                for node_id, need in used.items():
                    left[node_id] -= need
                continue
        offered = [Offered(m.node_id, m.name, m.engine, m.device, m.dtype, left[m.node_id]) for m in members]
        try:
            decision = place_one(ask, offered, figures.get(ask.model) or {}, decide)
        except NoRoom as exc:
            placed[ask.key] = Placed(ask, None, f"cannot place {ask.key}: {exc}", ids, seen)
            continue
        result = Placed(ask, decision, decision.problem, ids, seen)
        placed[ask.key] = result
        if result.plan is not None:
            for node_id, need in held_bytes(result.plan, ask.footprint, members).items():
                left[node_id] -= need
    return placed


def _same_ask(before: InstanceAsk, now: InstanceAsk) -> bool:
    """Whether a placed instance is still asked for as it was. Tensor-parallel slices are offered to the oldest
    instance only, so they appear when the instances asked before it go: that alone does not move it (its requests
    would replay on a new plan); the next re-placement (a member joins or leaves) forms the groups."""
    return replace(before, tensor_sizes=now.tensor_sizes) == now


def to_unload(ask: InstanceAsk, loaded: Sequence[InstanceAsk], idle: Sequence[str], members: Sequence[Member],
              figures: Figures, decide: Decide, current: Mapping[str, Placed] | None = None) -> list[str] | None:
    """The idle instances to unload, least recently used first, so that `ask` fits beside what stays: [] when it
    fits as things are (or its plan waits for the members' speed figures); None when it does not fit even with
    every idle instance gone (a busy one is never taken).

    `loaded`: the instances placed now, oldest first; `idle`: the keys of those with no request running, least
    recently used first."""
    gone: list[str] = []
    for victim in [None, *idle]:
        if victim is not None:
            gone.append(victim)
        staying = [a for a in loaded if a.key not in gone]
        placed = place_instances([*staying, ask], members, figures, decide, current)
        if placed[ask.key].problem is None:  # a plan, or one pending while members measure their speed
            return gone
    return None
