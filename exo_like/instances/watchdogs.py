"""The node's watchdogs over its instances' parts: a ring with a hung stage, and a tensor-parallel worker that
exited while its plan stands."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from exo_like.cluster.membership import Cluster
from exo_like.instances.manager import Instances
from exo_like.instances.runtime import InstancePart
from exo_like.tensor_parallel.supervisor import GroupSupervisor

log = logging.getLogger(__name__)

STEP_WATCH_SECONDS = 1.0
GROUP_WATCH_SECONDS = 0.2


class Watchdogs:
    def __init__(self, node_id: str, cluster: Cluster, instances: Instances, groups: GroupSupervisor,
                 parts: Callable[[], list[InstancePart]], step_timeout: float):
        self.node_id = node_id
        self.cluster = cluster
        self.instances = instances
        self.groups = groups
        self.parts = parts
        self.step_timeout = step_timeout

    async def watch_steps(self) -> None:
        """Stop requests whose ring has a hung stage: one whose node is alive (so its link stays up) while its
        engine has been inside one step for longer than --step-timeout."""
        while True:
            await asyncio.sleep(STEP_WATCH_SECONDS)
            for part in self.parts():
                part.generator.fail_stalled(self.step_seconds, self.step_timeout)

    def step_seconds(self, node_id: str) -> float:
        """How long a member's engine has been inside its current step: ours now, a peer's as last announced."""
        if node_id == self.node_id:
            return max((part.stage.step_seconds() for part in self.parts()), default=0.0)
        announcement = self.cluster.announcements.get(node_id)
        return announcement.load.step_seconds if announcement is not None else 0.0

    async def watch_group(self) -> None:
        """Re-form this node's tensor-parallel group when its worker exits while the plan stands (a crash, or the
        group broke because another member's did): the others' workers exit too, and every member starts anew."""
        handled: int | None = None  # the exited worker already acted on
        while True:
            await asyncio.sleep(GROUP_WATCH_SECONDS)
            worker = self.groups.worker
            if worker is None or worker.pid == handled or not self.groups.broken():
                continue
            handled = worker.pid
            log.warning("node %s: the worker of its tensor-parallel rank (process %d) exited with code %s; the "
                        "group forms anew", self.node_id, worker.pid, worker.process.returncode)
            for instance in self.instances.instances.values():
                if instance.part.shards.grouped:  # type: ignore[attr-defined]
                    instance.reload()
