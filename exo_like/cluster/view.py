"""The cluster as GET /v1/cluster returns it and the dashboard draws it: members, plan, agreement, each member's
announced load and part in the plan (its layers; its rank in a tensor-parallel group), and why the layers are placed
as they are (measured speeds, each stage's share of the time per token, the bottleneck, nodes left out and why, the
predicted time per token against the measured one)."""

from __future__ import annotations

import time
from typing import Any, Mapping, Protocol

from exo_like.cluster.membership import DEPARTED_SHOWN_SECONDS, Cluster
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.models.footprint import ModelDescription
from exo_like.models.shard import Shard
from partitioning.decision import PlacementReport
from partitioning.plan import Holder, Plan, needed_bytes
from partitioning.speed_figures import SpeedFigures


class InstanceView(Protocol):
    """What the picture reads of an instance (instances/instance.py)."""

    model: str
    key: str
    plan: Plan | None
    problem: str | None
    placement: PlacementReport | None

    @property
    def agreed(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    def why_not_ready(self) -> str: ...
    def node_status(self, node_id: str) -> str: ...


class InstancesView(Protocol):
    """What the picture reads of the cluster's instances (instances/manager.py)."""

    @property
    def instances(self) -> Mapping[str, InstanceView]: ...
    def figures_of(self, node_id: str, model: str | None) -> SpeedFigures | None: ...
    def description(self, model: str) -> ModelDescription | None: ...
    def in_flight(self, model: str) -> int: ...
    def expires_in(self, model: str) -> float | None: ...


def cluster_picture(cluster: Cluster, instances: InstancesView, names: Mapping[str, str] | None = None,
                    now: float | None = None) -> dict[str, Any]:
    """What GET /v1/cluster returns and the dashboard shows: the same picture on every node. `names`: each served
    model's name as /v1/models lists it, by key; `now`: the cluster's monotonic clock, which departures are timed
    by. The fields outside `instances` describe the oldest instance (a cluster serving one model: that one)."""
    now = time.monotonic() if now is None else now
    names = names or {}
    members = sorted(cluster.members(), key=lambda m: (-m.memory_bytes, m.node_id))
    pictures = [_instance_json(cluster, instances, instance, members, names)
                for instance in instances.instances.values()]
    first = next(iter(instances.instances.values()), None)
    placement = (first.placement if first else None) or PlacementReport("memory", "no plan yet")
    nodes = [_member_json(cluster, instances, first, m, placement) for m in members]
    oldest = pictures[0] if pictures else {}
    return {
        "node_id": cluster.me.node_id,
        "model": first.model if first else None,
        "model_name": oldest.get("model_name"),
        "nodes": nodes,
        "departed": [{**info_json(info), "status": "unreachable", "lost_seconds_ago": round(now - lost, 1)}
                     for info, lost in cluster.departed.values() if now - lost <= DEPARTED_SHOWN_SECONDS],
        # This node's own view (unlike the rest): peers it knows of but could not link with, and why.
        "unlinked": cluster.peers.problems.to_json(),
        **{key: oldest.get(key) for key in ("plan", "placement", "agreed", "ready", "problem", "model_bytes",
                                            "architecture", "parameters")},
        "agreed": bool(oldest.get("agreed")),
        "ready": bool(oldest.get("ready")),
        "waiting_for": oldest.get("waiting_for", "no model selected"),
        "instances": pictures,
        "total_memory_bytes": sum(m.memory_bytes for m in members),
        # Each token counted once, by the node that streams it to its client.
        "tokens_per_second": round(sum(n["generated_per_second"] for n in nodes), 2),
        "requests_in_flight": sum(n["in_flight"] for n in nodes),
    }


def _instance_json(cluster: Cluster, instances: InstancesView, instance: InstanceView, members: list[NodeInfo],
                   names: Mapping[str, str]) -> dict[str, Any]:
    description = instances.description(instance.model)
    nodes = {m.node_id: {"status": instance.node_status(m.node_id), **_part_json(instance.plan, m.node_id),
                         "used_bytes": _used_bytes(description, instance.plan, m)} for m in members}
    placement = instance.placement
    stage_steps = _stage_steps(cluster, instance.plan)
    return {
        "id": instance.key,
        "model": instance.model,
        "model_name": names.get(instance.model),
        "plan": instance.plan.to_json() if instance.plan else None,
        "placement": {**placement.to_json({m.node_id: m.name for m in members}),
                      "measured_time_per_token_ms": stage_steps} if placement else None,
        "agreed": instance.agreed,
        "ready": instance.ready,
        "problem": instance.problem,
        "waiting_for": None if instance.ready else instance.why_not_ready(),
        "model_bytes": _model_bytes(description),
        **_model_kind(description),
        "in_flight": instances.in_flight(instance.key),
        "expires_in_seconds": _rounded(instances.expires_in(instance.key)),
        "nodes": nodes,
    }


def _member_json(cluster: Cluster, instances: InstancesView, first: InstanceView | None, member: NodeInfo,
                 placement: PlacementReport) -> dict[str, Any]:
    announcement = cluster.announcement_of(member.node_id)
    load = announcement.load if announcement else NodeLoad()
    model = first.model if first else None
    problems = [state.problem for state in (announcement.instances.values() if announcement else ())
                if state.problem]
    used = 0
    for instance in instances.instances.values():
        used += _used_bytes(instances.description(instance.model), instance.plan, member)
    return {**info_json(member), "status": first.node_status(member.node_id) if first else "idle",
            "used_bytes": used, **load.to_json(),
            "download": load.download.to_json() if load.download is not None else None,
            "problem": problems[0] if problems else None,
            **placement.node_json(member.node_id, instances.figures_of(member.node_id, model), model),
            **_part_json(first.plan if first else None, member.node_id)}


def _part_json(plan: Plan | None, node_id: str) -> dict[str, Any]:
    """The member's part in the plan: the stage it runs (its index in the pipeline), its layers, and in a
    tensor-parallel stage its rank (a follower runs its slice of every layer of its leader's range; the stage's
    predicted time (stage_ms) and its measured step (decode_step_ms) are on the leader's entry)."""
    for index, stage in enumerate(plan.stages if plan else ()):
        if node_id in stage.members:
            tp = {"rank": stage.members.index(node_id), "size": len(stage.members), "leader": stage.node_id} \
                if stage.group else None
            return {"stage": index, "start_layer": stage.start_layer, "end_layer": stage.end_layer, "tp": tp}
    return {"stage": None, "start_layer": None, "end_layer": None, "tp": None}


def _stage_steps(cluster: Cluster, plan: Plan | None) -> float | None:
    """A token's measured time through the plan's layers: the stages' recent decode steps added (a tensor-parallel
    stage's is its leader's). The hops between stages are not in it. None until every stage has one."""
    if plan is None:
        return None
    steps = []
    for stage in plan.stages:
        announcement = cluster.announcement_of(stage.node_id)
        steps.append(announcement.load.decode_step_ms if announcement is not None else None)
    if not steps or any(step is None for step in steps):
        return None
    return round(sum(steps), 2)  # type: ignore[arg-type]


def _used_bytes(description: ModelDescription | None, plan: Plan | None, member: NodeInfo) -> int:
    """Parameter bytes of the member's layers in an instance's plan, as its engine and dtype hold them (what the
    fit check counts)."""
    shard = plan.shard_for(member.node_id) if plan else None
    if description is None or shard is None:
        return 0
    return needed_bytes(description.footprint, Holder(member.engine, member.dtype, member.device), shard)


def _model_bytes(description: ModelDescription | None) -> int | None:
    if description is None:
        return None
    return description.footprint.shard_bytes(Shard("whole", 0, description.n_layers, description.n_layers))


def _model_kind(description: ModelDescription | None) -> dict[str, Any]:
    """The model's architecture and parameters (total, and active per token), once it is described."""
    if description is None:
        return {"architecture": None, "parameters": None}
    return {"architecture": description.architecture, "parameters": description.parameters}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def info_json(m: NodeInfo) -> dict[str, Any]:
    return {"id": m.node_id, "name": m.name, "address": f"{m.host}:{m.port}", "engine": m.engine,
            "device": m.device, "dtype": m.dtype, "chip": m.chip, "memory_bytes": m.memory_bytes,
            "version": m.version}
