"""This node's part of one instance: an engine of its own (holding this node's shard of the instance's model, if
the plan gives it one), the stage that serves the instance's plan, and the generator of this node's own clients'
requests for the model. Every part of a node shares its engine thread, so their steps never run at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from exo_like.engines.base import Engine
from exo_like.engines.choice import create_engine
from exo_like.engines.work import KVPoolSize
from exo_like.instances.instance import Instance
from exo_like.models.hub.download import ShardDownloader
from exo_like.models.names.model_registry import ModelRegistry
from exo_like.models.shard import Shard
from exo_like.serving.grammar import GrammarVocabularies, GrammarVocabulary
from exo_like.serving.ring_generator import RingGenerator
from exo_like.serving.scheduler import SchedulerLimits
from exo_like.serving.shard_holder import ShardHolder
from exo_like.serving.stage import Router, StageWorker
from exo_like.tensor_parallel.supervisor import GroupSpec, GroupSupervisor
from partitioning.plan import Plan

log = logging.getLogger(__name__)


@dataclass
class NodeServices:
    """What every instance's part on a node shares: the node's router, engine thread, model files and options."""

    node_id: str
    router: Router
    executor: ThreadPoolExecutor
    models: ModelRegistry
    downloader: ShardDownloader
    grammars: GrammarVocabularies
    engine: tuple[str, str | None, str | None]  # --engine, --device, --dtype
    kv_cache_gb: float | None
    limits: SchedulerLimits
    names: Callable[[str], str]  # a node's name by id (errors about a lost node name it)
    request_wait: float  # how long a broken request waits for a ring to replay on
    on_step: Callable[[float, int], None] | None = None  # every engine step's (seconds, rows), for /metrics
    on_replay: Callable[[], None] | None = None
    groups: GroupSupervisor | None = None  # this node's tensor-parallel rank (one group per node at most)
    group_spec: Callable[[Plan, Shard], GroupSpec] | None = None


class InstancePart:
    def __init__(self, instance: Instance, services: NodeServices):
        self.model = instance.model
        self.services = services
        self.engine: Engine = create_engine(*services.engine)
        self.shards = ShardHolder(services.node_id, self.engine, services.executor, services.models,
                                  services.downloader, services.kv_cache_gb, services.limits, services.groups,
                                  services.group_spec, instance.key)
        self.stage = StageWorker(services.node_id, services.router, services.executor, instance.ring_resources,
                                 services.limits, services.on_step, self.grammar_vocabulary)
        self.generator = RingGenerator(services.node_id, services.router, instance.wait_ready, self.stage,
                                       services.names, services.request_wait, services.on_replay)

    async def hold(self, plan: Plan, shard: Shard | None) -> None:
        if shard is None and self.shards.held is not None:
            await self.shards.unload(self.stage)  # its layers went to other nodes: their memory goes back
        await self.shards.hold(plan, shard, self.stage)

    def kv_size(self) -> KVPoolSize | None:
        return self.shards.serving.kv_size

    @property
    def serving(self) -> Engine:
        """The engine holding this node's shard: its own, or its tensor-parallel worker's."""
        return self.shards.serving

    def grammar_vocabulary(self) -> GrammarVocabulary | None:
        """The model's tokens as the grammar engine sees them (built on first use: call it off the loop)."""
        model = self.services.models.known(self.model)
        return None if model is None else self.services.grammars.get(model)

    async def close(self, reason: str, code: str) -> None:
        """The instance is unloaded: its requests end with `reason`, its layers' memory goes back."""
        await self.generator.close(reason, code)
        await self.shards.unload(self.stage)
        await self.stage.close()
        log.info("node %s: unloaded %s", self.services.node_id, self.model)
