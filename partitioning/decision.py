"""Which placement the cluster uses for its model, from what every member announced, and what to show about it.

Placement by speed (the default) needs every member's measured layer speed for the model. It is used when every
member runs with --placement compute and has measured the model; otherwise:
- a member that runs with --placement memory, or could not measure, makes the plan the memory split (and says so);
- while members are still measuring, there is no plan yet (waiting_for says whose figures are missing), except
  that a ring already serving this model goes on: members measuring are left out of it until they have figures
  (a node joining a running cluster measures while the others keep serving).
Each node decides from the announced figures alone (its own included, as announced), so all decide alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from exo_like.models.footprint import ModelFootprint
from partitioning import NodeCapacity, Placement, stage_times
from partitioning.plan import Holder, Plan, fit_problems, make_plan, make_speed_plan, speed_nodes
from partitioning.speed_figures import RTT_FLOOR_US, SpeedFigures
from partitioning.tensor import allreduce_ns, group_layer_ns, tensor_stages

PLAN_CACHE = 16  # speed plans kept by their inputs: re-plans with the same figures cost nothing
# --parallel auto takes tensor-parallel groups only when they predict at least 10 % less time per token than the
# pipeline: the figures are measurements with noise, and a re-plan restarts every request.
TENSOR_GAIN = (9, 10)


class Member(Protocol):
    """What placement reads of a cluster member (the cluster's NodeInfo carries these and more)."""

    @property
    def node_id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> str | None: ...
    @property
    def memory_bytes(self) -> int: ...


@dataclass(frozen=True)
class PlacementReport:
    """Why the plan is what it is: for GET /v1/cluster and the dashboard."""

    mode: str  # "compute", "memory" or "tensor"
    why: str
    stage_ns: dict[str, int] = field(default_factory=dict)  # each stage's time per token, when the figures allow
    bottleneck: str | None = None  # node id of the slowest stage
    left_out: tuple[tuple[str, str], ...] = ()  # (node id, reason): members that hold no layers, and why
    measuring: tuple[str, ...] = ()  # members whose figures for the model are not in yet
    predicted: dict[str, int] = field(default_factory=dict)  # time per token of the plans weighed: "pipeline", ...

    def to_json(self, names: dict[str, str]) -> dict[str, Any]:
        total = sum(self.stage_ns.values())
        return {"mode": self.mode, "why": self.why, "bottleneck": self.bottleneck,
                "bottleneck_ms": _ms(self.stage_ns.get(self.bottleneck)) if self.bottleneck else None,
                "time_per_token_ms": _ms(total) if self.stage_ns else None,
                "predicted_ms": {kind: _ms(ns) for kind, ns in self.predicted.items()},
                "left_out": [{"node_id": node_id, "name": names.get(node_id, node_id), "reason": reason}
                             for node_id, reason in self.left_out],
                "measuring": list(self.measuring)}

    def describe(self) -> str:
        """One line for the log: the rule, the slowest stage, and who is left out and why."""
        parts = [self.why]
        if self.bottleneck is not None:
            parts.append(f"slowest stage {self.bottleneck} {_ms(self.stage_ns[self.bottleneck])} ms of "
                         f"{_ms(sum(self.stage_ns.values()))} ms per token")
        parts.extend(f"left out {node_id}: {reason}" for node_id, reason in self.left_out)
        return "; ".join(parts)

    def node_json(self, node_id: str, figures: SpeedFigures | None, model: str | None) -> dict[str, Any]:
        """A member's measured speed, its stage's time and share of the time per token, and whether it is the
        bottleneck."""
        total = sum(self.stage_ns.values())
        stage = self.stage_ns.get(node_id)
        speed = None
        if figures is not None and figures.model == model and model is not None:
            speed = {"decode_ms_per_layer": _ms(figures.decode_ns), "prefill_ms_per_token": _ms(figures.prefill_ns),
                     "measure_seconds": figures.measure_seconds, "cached": figures.cached,
                     "problem": figures.problem,
                     "slice_ms_per_layer": {size: _ms(ns) for size, ns in figures.slice_decode_ns.items()}}
        links = {peer: {"round_trip_us": figures.link_us.get(peer), "mbit_s": figures.link_mbit.get(peer)}
                 for peer in sorted({*figures.link_us, *figures.link_mbit})} if figures is not None else {}
        return {"speed": speed, "stage_ms": _ms(stage), "share": round(stage / total, 3) if stage and total else None,
                "bottleneck": node_id == self.bottleneck, "links": links}


@dataclass(frozen=True)
class Decision:
    plan: Plan | None
    problem: str | None
    pending: str | None  # why there is no plan yet although the model is described
    report: PlacementReport


class Placer:
    """Decides the plan for one node's view (keeps the last speed plans computed, by their inputs)."""

    def __init__(self, me: str):
        self.me = me
        self._plans: dict[tuple, tuple[Plan, Placement] | None] = {}

    def decide(self, model: str, n_layers: int, footprint: ModelFootprint, members: list[Member],
               figures: dict[str, SpeedFigures | None], current: Plan | None,
               tensor_sizes: tuple[int, ...] = (), tensor_engines: tuple[str, ...] = ("torch", "mlx")) -> Decision:
        """tensor_sizes: the tensor-parallel group sizes the model's layers split over; tensor_engines: the
        engines whose nodes can form such groups for it."""
        names = {m.node_id: m.name for m in members}
        holders = {m.node_id: Holder(m.engine, m.dtype, m.device) for m in members}
        # the kind of node each may form a group with: its engine, if that engine splits the model
        grouping = {m.node_id: m.engine if m.engine in tensor_engines else f"alone:{m.node_id}" for m in members}
        if tensor_wanted(figures):
            return self._tensor(model, n_layers, footprint, members, holders, tensor_sizes, grouping, names)
        memory_reason = self._memory_reason(model, figures, names)
        if memory_reason is not None:
            return self._memory(model, n_layers, footprint, members, figures, holders, memory_reason)
        measuring = tuple(sorted(m.node_id for m in members if not _measured(figures.get(m.node_id), model)))
        if measuring and not self._keeps_serving(current, model, measuring, members):
            who = ", ".join(names[n] for n in measuring)
            report = PlacementReport("compute", f"waiting for the measured speed of {who}", measuring=measuring)
            return Decision(None, None, f"waiting for nodes {', '.join(measuring)} to measure their speed on the "
                            "model (placement by speed)", report)
        placed = [m for m in members if m.node_id not in measuring]
        capacities = [NodeCapacity(m.node_id, m.memory_bytes) for m in placed]
        layer_ns = {m.node_id: figures[m.node_id].decode_ns for m in placed}  # type: ignore[union-attr]
        hop = hop_table(figures)
        key = (model, n_layers, footprint, tuple(capacities), tuple(sorted(layer_ns.items())),
               tuple(sorted(holders.items())), tuple(sorted(hop.items())))
        if key not in self._plans:
            while len(self._plans) >= PLAN_CACHE:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = make_speed_plan(model, n_layers, capacities, layer_ns, footprint, holders,
                                               lambda a, b: hop_ns(hop, a, b))
        result = self._plans[key]
        if result is None:  # no split fits: the memory split's problems say what is missing where
            plan = make_plan(model, n_layers, [NodeCapacity(m.node_id, m.memory_bytes) for m in members],
                             footprint.layer_bytes)
            problems = fit_problems(plan, footprint, holders)
            return Decision(plan, "the model does not fit: " + "; ".join(problems),
                            None, PlacementReport("compute", "no split by speed fits every node's memory"))
        plan, placement = result
        waiting = tuple((n, "measuring its speed: it joins the ring once measured") for n in measuring)
        predicted: dict[str, int] = {"pipeline": placement.total_ns}
        if tensor_sizes and not any(f is not None and f.parallel == "pipeline" for f in figures.values()):
            candidate = self._tensor_candidate(model, n_layers, footprint, placed, figures, holders, tensor_sizes,
                                               grouping, layer_ns, hop)
            if candidate is not None:
                tensor_plan, tensor_ns = candidate
                predicted["tensor"] = sum(tensor_ns)
                if predicted["tensor"] * TENSOR_GAIN[1] < placement.total_ns * TENSOR_GAIN[0]:
                    report = PlacementReport(
                        "tensor", f"tensor parallel: {predicted['tensor'] / 1e6:.1f} ms per token predicted "
                        f"against {placement.total_ns / 1e6:.1f} ms for the pipeline",
                        dict(zip(tensor_plan.node_ids, tensor_ns)),
                        max(zip(tensor_ns, tensor_plan.node_ids))[1], waiting, measuring, predicted)
                    return Decision(tensor_plan, None, None, report)
        how = placement.how if "tensor" not in predicted else \
            f"{placement.how} (a pipeline: {placement.total_ns / 1e6:.1f} ms per token predicted, tensor " \
            f"parallel {predicted['tensor'] / 1e6:.1f} ms)"
        report = PlacementReport("compute", how, {s.node_id: t for s, t in zip(plan.stages, placement.stage_ns)},
                                 placement.bottleneck, tuple((x.node_id, x.reason) for x in placement.left_out)
                                 + waiting, measuring, predicted)
        return Decision(plan, None, None, report)

    def _tensor_candidate(self, model: str, n_layers: int, footprint: ModelFootprint, members: list[Member],
                          figures: dict[str, SpeedFigures | None], holders: dict[str, Holder],
                          sizes: tuple[int, ...], grouping: dict[str, str], layer_ns: dict[str, int],
                          hop: dict[tuple[str, str], int]) -> tuple[Plan, tuple[int, ...]] | None:
        """The plan with tensor-parallel groups (tensor.py) and each stage's predicted time per token; None when no
        group forms, it does not fit, or a member has not measured its slice."""
        capacities = [NodeCapacity(m.node_id, m.memory_bytes) for m in members]
        stages = tensor_stages(n_layers, capacities, grouping, sizes, footprint.layer_bytes)
        plan = Plan(model, n_layers, tuple(stages), tuple(sorted((c.node_id, c.memory_bytes) for c in capacities)))
        if not any(s.group for s in stages) or fit_problems(plan, footprint, holders):
            return None
        measured = {key: ns for f in figures.values() if f is not None for key, ns in f.allreduce_ns.items()}
        slices = {node_id: f.slice_decode_ns for node_id, f in figures.items() if f is not None}
        speeds = {n.node_id: n for n in speed_nodes(capacities, layer_ns, footprint, holders)}
        for stage in (s for s in stages if s.group):
            per_layer = group_layer_ns(stage.members, slices,
                                       allreduce_ns(stage.members, measured, lambda a, b: link_us(figures, a, b)))
            if per_layer is None:
                return None
            speeds[stage.node_id] = replace(speeds[stage.node_id], layer_ns=per_layer)
        return plan, stage_times(n_layers, stages, list(speeds.values()), lambda a, b: hop_ns(hop, a, b))

    def _memory_reason(self, model: str, figures: dict[str, SpeedFigures | None], names: dict[str, str]
                       ) -> str | None:
        mine = figures.get(self.me)
        if mine is None or mine.placement == "memory":
            return "this node runs with --placement memory"
        asked = sorted(names.get(n, n) for n, f in figures.items() if f is not None and f.placement == "memory")
        if asked:
            return f"{', '.join(asked)} {'runs' if len(asked) == 1 else 'run'} with --placement memory"
        failed = sorted((names.get(n, n), f.problem) for n, f in figures.items() if f is not None and
                        f.failed_for(model))
        if failed:
            return f"{failed[0][0]} {failed[0][1]}"
        return None

    def _memory(self, model: str, n_layers: int, footprint: ModelFootprint, members: list[Member],
                figures: dict[str, SpeedFigures | None], holders: dict[str, Holder], why: str) -> Decision:
        """Today's memory split, with its stages' times per token where every stage has figures."""
        capacities = [NodeCapacity(m.node_id, m.memory_bytes) for m in members]
        plan = make_plan(model, n_layers, capacities, footprint.layer_bytes)
        problems = fit_problems(plan, footprint, holders)
        stage_ns: dict[str, int] = {}
        used = [c for c in capacities if c.node_id in plan.node_ids]
        if all(_measured(figures.get(c.node_id), model) for c in used):
            layer_ns = {c.node_id: figures[c.node_id].decode_ns for c in used}  # type: ignore[union-attr]
            hop = hop_table(figures)
            times = stage_times(n_layers, plan.stages, speed_nodes(used, layer_ns, footprint, holders),
                                lambda a, b: hop_ns(hop, a, b))
            stage_ns = {s.node_id: t for s, t in zip(plan.stages, times)}
        bottleneck = max(stage_ns, key=lambda n: (stage_ns[n], -plan.node_ids.index(n))) if stage_ns else None
        left = tuple((c.node_id, "more nodes than layers: the memory split gives it none") for c in capacities
                     if c.node_id not in plan.node_ids)
        report = PlacementReport("memory", f"split by memory: {why}", stage_ns, bottleneck, left)
        return Decision(plan, ("the model does not fit: " + "; ".join(problems)) if problems else None, None, report)

    def _tensor(self, model: str, n_layers: int, footprint: ModelFootprint, members: list[Member],
                holders: dict[str, Holder], sizes: tuple[int, ...], grouping: dict[str, str],
                names: dict[str, str]) -> Decision:
        """Every member asked for --parallel tensor: groups of same-engine nodes, split by memory."""
        capacities = [NodeCapacity(m.node_id, m.memory_bytes) for m in members]
        stages = tensor_stages(n_layers, capacities, grouping, sizes, footprint.layer_bytes)
        plan = Plan(model, n_layers, tuple(stages), tuple(sorted((c.node_id, c.memory_bytes) for c in capacities)))
        problems = fit_problems(plan, footprint, holders)
        groups = [s for s in stages if s.group]
        if groups:
            why = "tensor parallel (--parallel tensor): " + "; ".join(
                f"{', '.join(names.get(n, n) for n in s.members)} run layers [{s.start_layer}, {s.end_layer}) "
                "together" for s in groups)
        else:
            why = (f"--parallel tensor, but no group forms: the model splits over groups of "
                   f"{', '.join(map(str, sizes)) or 'no size'}, and no engine has that many nodes")
        left = tuple((c.node_id, "more nodes than layers: the memory split gives it none") for c in capacities
                     if c.node_id not in plan.member_ids)
        report = PlacementReport("tensor", why, left_out=left)
        return Decision(plan, ("the model does not fit: " + "; ".join(problems)) if problems else None, None, report)

    def _keeps_serving(self, current: Plan | None, model: str, measuring: tuple[str, ...],
                       members: list[Member]) -> bool:
        """Whether the ring already serving this model goes on while the members in `measuring` measure: it does
        when this node has its figures and every stage of that ring is a member with figures."""
        live = {m.node_id for m in members}
        return current is not None and current.model_id == model and self.me not in measuring and \
            all(s.node_id in live and s.node_id not in measuring for s in current.stages)


def link_us(figures: dict[str, SpeedFigures | None], a: str, b: str) -> int:
    """A link's finer round trip (SpeedFigures.link_us), the larger of the two ends' (RTT_FLOOR_US if neither
    has measured it)."""
    seen = [f.link_us[peer] for node, peer in ((a, b), (b, a))
            if (f := figures.get(node)) is not None and peer in f.link_us]
    return max(seen, default=RTT_FLOOR_US)


def tensor_wanted(figures: dict[str, SpeedFigures | None]) -> bool:
    """Whether every member runs with --parallel tensor (and has said so)."""
    return bool(figures) and all(f is not None and f.parallel == "tensor" for f in figures.values())


def hop_table(figures: dict[str, SpeedFigures | None]) -> dict[tuple[str, str], int]:
    """Round trip of each link as both ends announce it, in microseconds: the larger of the two, so every node
    reads one figure per link whichever end it asks."""
    table: dict[tuple[str, str], int] = {}
    for node_id, mine in figures.items():
        if mine is None:
            continue
        for peer, rtt in mine.rtt_us.items():
            pair = (min(node_id, peer), max(node_id, peer))
            table[pair] = max(table.get(pair, 0), rtt)
    return table


def hop_ns(table: dict[tuple[str, str], int], a: str, b: str) -> int:
    """One way from a to b: half the link's round trip (RTT_FLOOR_US when neither end has measured it yet)."""
    return table.get((min(a, b), max(a, b)), RTT_FLOOR_US) * 1000 // 2


def _measured(figures: SpeedFigures | None, model: str) -> bool:
    return figures is not None and figures.measured_for(model)


def _ms(ns: int | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)
