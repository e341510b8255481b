"""Several instances on one cluster (partitioning/instances.py), without sockets: each placed on the memory the
ones asked before it left, an instance placed before keeps its plan while others come and go, and a model that
does not fit unloads the least recently used idle instances, never a busy one."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from exo_like.models.footprint import ModelFootprint
from partitioning.decision import Placer
from partitioning.instances import InstanceAsk, Placed, held_bytes, place_instances, ranked, to_unload
from partitioning.plan import needed_bytes
from partitioning.speed_figures import SpeedFigures

GIB = 1 << 30


def footprint(layers: int, layer_gib: float) -> ModelFootprint:
    return ModelFootprint(layer_bytes=(int(layer_gib * GIB),) * layers, embed_bytes=GIB // 8, head_bytes=GIB // 8,
                          tied=False, stored_dtype_bytes=2)


@dataclass(frozen=True)
class Member:
    node_id: str
    memory_bytes: int
    engine: str = "torch"
    name: str = ""
    device: str = "cpu"
    dtype: str | None = None


MEMBERS = [Member("a", 8 * GIB), Member("b", 8 * GIB), Member("c", 8 * GIB)]
BY_MEMORY = {m.node_id: SpeedFigures(placement="memory") for m in MEMBERS}


class EveryModel(Mapping):
    """The same members' figures for whichever model placement asks about."""

    def __init__(self, figures: dict[str, SpeedFigures | None]):
        self.figures = figures

    def __getitem__(self, model: str) -> dict[str, SpeedFigures | None]:
        return self.figures

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


ALL = EveryModel(BY_MEMORY)


def decide_with(figures: dict[str, SpeedFigures | None]):  # noqa: ANN201
    placer = Placer("a")
    return lambda ask, members, announced: placer.decide(ask.model, ask.n_layers, ask.footprint, members,
                                                         {**announced, **figures}, None, ask.tensor_sizes,
                                                         ask.tensor_engines)


def ask(model: str, layers: int = 8, layer_gib: float = 1.0, nodes: tuple[str, ...] = ()) -> InstanceAsk:
    return InstanceAsk(model, layers, footprint(layers, layer_gib), nodes)


def used_per_node(placed: dict[str, Placed]) -> dict[str, int]:
    used = {m.node_id: 0 for m in MEMBERS}
    for result in placed.values():
        for node_id, held in held_bytes(result.plan, result.ask.footprint, MEMBERS).items():
            used[node_id] += held
    return used


def test_instances_share_each_nodes_memory_and_none_holds_more_than_offered() -> None:
    asks = [ask("A"), ask("B"), ask("C", layers=4)]
    placed = place_instances(asks, MEMBERS, ALL, decide_with(BY_MEMORY))
    assert all(placed[a.model].plan is not None for a in asks), {m: p.problem for m, p in placed.items()}
    assert all(used <= 8 * GIB for used in used_per_node(placed).values())
    for a in asks:  # each a whole model: every layer on exactly one stage
        plan = placed[a.model].plan
        assert plan.stages[0].start_layer == 0 and plan.stages[-1].end_layer == a.n_layers
        assert all(x.end_layer == y.start_layer for x, y in zip(plan.stages, plan.stages[1:]))


def test_a_model_that_does_not_fit_beside_the_others_has_a_problem_and_moves_nothing() -> None:
    first = place_instances([ask("A"), ask("B")], MEMBERS, ALL, decide_with(BY_MEMORY))
    both = place_instances([ask("A"), ask("B"), ask("big", layers=8, layer_gib=1.5)], MEMBERS, ALL,
                           decide_with(BY_MEMORY), first)
    assert both["big"].plan is None and "does not fit" in both["big"].problem
    assert both["A"] is first["A"] and both["B"] is first["B"]


def test_an_instance_keeps_its_plan_when_another_goes_and_re_places_when_the_members_change() -> None:
    decide = decide_with(BY_MEMORY)
    before = place_instances([ask("A"), ask("B")], MEMBERS, ALL, decide)
    after = place_instances([ask("B")], MEMBERS, ALL, decide, before)
    assert after["B"] is before["B"]  # A unloaded: B's requests go on on the same plan
    oldest = place_instances([replace(ask("B"), tensor_sizes=(8,) * 8)], MEMBERS, ALL, decide, before)
    assert oldest["B"] is before["B"]  # now the oldest, B is offered tensor slices: not a reason to move it
    fresh = place_instances([ask("B")], MEMBERS, ALL, decide)
    assert fresh["B"].plan.digest != before["B"].plan.digest  # alone, B would have been split otherwise
    two = MEMBERS[:2]
    shrunk = place_instances([ask("B")], two, EveryModel({n: BY_MEMORY[n] for n in ("a", "b")}), decide, before)
    assert shrunk["B"] is not before["B"] and set(shrunk["B"].plan.node_ids) <= {"a", "b"}


def test_chosen_nodes_are_the_only_ones_an_instance_runs_on() -> None:
    placed = place_instances([ask("A", layers=4, nodes=("c", "b"))], MEMBERS, ALL, decide_with(BY_MEMORY))
    assert set(placed["A"].plan.node_ids) <= {"b", "c"}
    nowhere = place_instances([ask("A", nodes=("z",))], MEMBERS, ALL, decide_with(BY_MEMORY))
    assert nowhere["A"].plan is None and "none of the chosen nodes (z)" in nowhere["A"].problem


def test_members_rank_by_measured_speed_when_all_measured_else_by_memory_left() -> None:
    members = [Member("a", 4 * GIB), Member("b", 8 * GIB), Member("c", 6 * GIB)]
    speeds = {"a": 1_000, "b": 3_000, "c": 2_000}
    measured = {n: SpeedFigures(model="A", decode_ns=ns) for n, ns in speeds.items()}
    assert [m.node_id for m in ranked(ask("A"), members, measured)] == ["a", "c", "b"]
    partly = {**measured, "b": SpeedFigures()}
    assert [m.node_id for m in ranked(ask("A"), members, partly)] == ["b", "c", "a"]
    assert [m.node_id for m in ranked(ask("A"), [*members, Member("d", 0)], partly)] == ["b", "c", "a"]


def test_a_model_that_needs_room_unloads_idle_instances_least_recently_used_first_never_a_busy_one() -> None:
    decide = decide_with(BY_MEMORY)
    loaded = [ask("A", 7), ask("B", 7), ask("C", 7)]  # 7 + 1/4 GiB each over 24 GiB: a fourth does not fit
    current = place_instances(loaded, MEMBERS, ALL, decide)
    assert all(p.plan is not None for p in current.values())
    wanted = ask("D", 7)
    assert to_unload(wanted, loaded, ["C", "A"], MEMBERS, ALL, decide, current) == ["C"]
    assert to_unload(wanted, loaded, [], MEMBERS, ALL, decide, current) is None  # all busy
    assert to_unload(ask("small", layers=1, layer_gib=0.25), loaded, ["A"], MEMBERS, ALL, decide,
                     current) == []  # fits as things are
    huge = ask("huge", layers=8, layer_gib=4)
    assert to_unload(huge, loaded, ["A", "B", "C"], MEMBERS, ALL, decide, current) is None


def test_held_bytes_are_what_each_stage_needs() -> None:
    placed = place_instances([ask("A")], MEMBERS, ALL, decide_with(BY_MEMORY))
    plan = placed["A"].plan
    held = held_bytes(plan, placed["A"].ask.footprint, MEMBERS)
    from partitioning.plan import Holder

    assert held == {s.node_id: needed_bytes(placed["A"].ask.footprint, Holder("torch", None, "cpu"),
                                            plan.shard_for(s.node_id)) for s in plan.stages}
