"""The cluster as GET /v1/cluster returns it and the dashboard draws it: members, plan, agreement, each member's
announced load and part in the plan (its layers; its rank in a tensor-parallel group), and why the layers are placed
as they are (measured speeds, each stage's share of the time per token, the bottleneck, nodes left out and why, the
predicted time per token against the measured one)."""

from __future__ import annotations

import time
from typing import Any

from exo_like.cluster.membership import DEPARTED_SHOWN_SECONDS, Cluster
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.models.shard import Shard
from partitioning.decision import PlacementReport
from partitioning.plan import Holder, needed_bytes


def cluster_picture(cluster: Cluster, now: float | None = None) -> dict[str, Any]:
    """What GET /v1/cluster returns and the dashboard shows: the same picture on every node. `now`: the cluster's
    monotonic clock, which departures are timed by."""
    now = time.monotonic() if now is None else now
    members = sorted(cluster.members(), key=lambda m: (-m.memory_bytes, m.node_id))
    placement = cluster.placement or PlacementReport("memory", "no plan yet")
    nodes = [_member_json(cluster, m, placement) for m in members]
    return {
        "node_id": cluster.me.node_id,
        "model": cluster.model_id,
        "nodes": nodes,
        "departed": [{**info_json(info), "status": "unreachable", "lost_seconds_ago": round(now - lost, 1)}
                     for info, lost in cluster.departed.values() if now - lost <= DEPARTED_SHOWN_SECONDS],
        # This node's own view (unlike the rest): peers it knows of but could not link with, and why.
        "unlinked": cluster.peers.problems.to_json(),
        "plan": cluster.plan.to_json() if cluster.plan else None,
        "placement": {**placement.to_json({m.node_id: m.name for m in members}),
                      "measured_time_per_token_ms": _measured_ms(cluster, nodes)} if cluster.placement else None,
        "agreed": cluster.agreed,
        "ready": cluster.ready,
        "problem": cluster.problem,
        "waiting_for": None if cluster.ready else cluster.why_not_ready(),
        "model_bytes": _model_bytes(cluster),
        **_model_kind(cluster),
        "total_memory_bytes": sum(m.memory_bytes for m in members),
        # Each token counted once, by the node that streams it to its client.
        "tokens_per_second": round(sum(n["generated_per_second"] for n in nodes), 2),
        "requests_in_flight": sum(n["in_flight"] for n in nodes),
    }


def _member_json(cluster: Cluster, member: NodeInfo, placement: PlacementReport) -> dict[str, Any]:
    announcement = cluster.announcement_of(member.node_id)
    load = announcement.load if announcement else NodeLoad()
    return {**info_json(member), "status": cluster.node_status(member.node_id),
            "used_bytes": _used_bytes(cluster, member), **load.to_json(),
            "download": load.download.to_json() if load.download is not None else None,
            "problem": announcement.problem if announcement else None,
            **placement.node_json(member.node_id, cluster.figures_of(member.node_id), cluster.model_id),
            **_part_json(cluster, member.node_id)}


def _part_json(cluster: Cluster, node_id: str) -> dict[str, Any]:
    """The member's part in the plan: the stage it runs (its index in the pipeline), its layers, and in a
    tensor-parallel stage its rank (a follower runs its slice of every layer of its leader's range; the stage's
    predicted time (stage_ms) and its measured step (decode_step_ms) are on the leader's entry)."""
    plan = cluster.plan
    for index, stage in enumerate(plan.stages if plan else ()):
        if node_id in stage.members:
            tp = {"rank": stage.members.index(node_id), "size": len(stage.members), "leader": stage.node_id} \
                if stage.group else None
            return {"stage": index, "start_layer": stage.start_layer, "end_layer": stage.end_layer, "tp": tp}
    return {"stage": None, "start_layer": None, "end_layer": None, "tp": None}


def _measured_ms(cluster: Cluster, nodes: list[dict[str, Any]]) -> float | None:
    """A token's measured time through the plan's layers: the stages' recent decode steps added (a tensor-parallel
    stage's is its leader's). The hops between stages are not in it. None until every stage has one."""
    steps = {node["id"]: node["decode_step_ms"] for node in nodes}
    stage_steps = [steps.get(stage.node_id) for stage in cluster.plan.stages] if cluster.plan else []
    known = [step for step in stage_steps if step is not None]
    if not stage_steps or len(known) < len(stage_steps):
        return None
    return round(sum(known), 2)


def _used_bytes(cluster: Cluster, member: NodeInfo) -> int:
    """Parameter bytes of the member's layers in the current plan, as its engine and dtype hold them (what the fit
    check counts)."""
    description = cluster.description()
    shard = cluster.plan.shard_for(member.node_id) if cluster.plan else None
    if description is None or shard is None:
        return 0
    return needed_bytes(description.footprint, Holder(member.engine, member.dtype, member.device), shard)


def _model_bytes(cluster: Cluster) -> int | None:
    description = cluster.description()
    if description is None:
        return None
    return description.footprint.shard_bytes(Shard("whole", 0, description.n_layers, description.n_layers))


def _model_kind(cluster: Cluster) -> dict[str, Any]:
    """The model's architecture and parameters (total, and active per token), once it is described."""
    description = cluster.description()
    if description is None:
        return {"architecture": None, "parameters": None}
    return {"architecture": description.architecture, "parameters": description.parameters}


def info_json(m: NodeInfo) -> dict[str, Any]:
    return {"id": m.node_id, "name": m.name, "address": f"{m.host}:{m.port}", "engine": m.engine,
            "device": m.device, "dtype": m.dtype, "chip": m.chip, "memory_bytes": m.memory_bytes,
            "version": m.version}
