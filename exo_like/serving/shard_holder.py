"""This node's part of the model: hold the agreed plan's layer range on the engine, then let the stage serve it.
In a tensor-parallel group, the engine is the node's worker for its rank (tensor_parallel/supervisor.py).

Holding a range means fetching the files it needs (a hub model), loading it on the engine thread, and sizing the
KV pool within the budget. A range already held is not loaded again. A newer plan cancels a load under way: the
engine thread gives up at its next tensor, and the range is forgotten so that a plan wanting it back loads it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from exo_like.engines.base import Engine
from exo_like.models.hub.download import ShardDownloader
from exo_like.models.names.model_registry import ModelRegistry
from exo_like.models.shard import Shard
from exo_like.serving.kv_blocks import kv_budget_bytes, pool_sizes
from exo_like.serving.scheduler import SchedulerLimits
from exo_like.serving.stage import StageWorker
from exo_like.tensor_parallel.process import GroupBroken
from exo_like.tensor_parallel.supervisor import GroupSpec, GroupSupervisor
from partitioning.plan import Plan

log = logging.getLogger(__name__)


class ShardHolder:
    """`groups`: runs this node's rank of a tensor-parallel group in a worker process (None: this node takes no part
    in groups); `group_spec`: a plan's group as this node's rank sees it (members' addresses included)."""

    def __init__(self, node_id: str, engine: Engine, executor: ThreadPoolExecutor, models: ModelRegistry,
                 downloader: ShardDownloader, kv_cache_gb: float | None, limits: SchedulerLimits,
                 groups: GroupSupervisor | None = None,
                 group_spec: Callable[[Plan, Shard], GroupSpec] | None = None, owner: str = ""):
        self.node_id = node_id
        self.engine = engine
        self.executor = executor
        self.models = models
        self.downloader = downloader
        self.kv_cache_gb = kv_cache_gb
        self.limits = limits  # the scheduler's, should this node be a first stage (they size the window pool)
        self.groups = groups
        self.group_spec = group_spec
        self.serving: Engine = engine  # the engine holding this node's shard: its own, or its group worker's
        # (model key, shard, which worker: 0 for the node's own engine) the serving engine holds
        self.held: tuple[str, Shard, int] | None = None
        self.owner = owner  # whose shard this is, to the node's downloader (the instance's key)
        self._grouped = False  # this holder's shard is a rank of the supervisor's group (one per node)

    @property
    def grouped(self) -> bool:
        """Whether this holder's shard is a rank of the node's tensor-parallel group."""
        return self._grouped

    async def hold(self, plan: Plan, shard: Shard | None, stage: StageWorker) -> None:
        """Hold this plan's shard (reloading only if the range or the group changed), then let the stage serve
        the plan (a follower of a tensor-parallel group serves no stage: its leader drives it)."""
        if shard is None:
            self._leave_group()
            stage.activate(plan, None)
            return
        engine = self.engine if shard.tp is None else await self._group_engine(plan, shard, stage)
        if shard.tp is None:
            self._leave_group()
        holding = (plan.model_id, shard, 0 if shard.tp is None else self.groups.formations)  # type: ignore
        if self.held != holding:
            stage.activate(None, None)
            await self._load(holding, engine, plan)
        stage.activate(plan, engine if shard.tp is None or shard.tp.is_leader else None)

    async def _group_engine(self, plan: Plan, shard: Shard, stage: StageWorker) -> Engine:
        """This node's worker for its rank of the plan's group, started (and the group formed) if need be."""
        if self.groups is None or self.group_spec is None:
            raise GroupBroken(f"node {self.node_id} cannot join tensor-parallel groups")
        spec = self.group_spec(plan, shard)
        if self.groups.spec != spec or self.groups.broken():
            stage.activate(None, None)  # the old worker's steps end here
        loop = asyncio.get_running_loop()
        self._grouped = True
        try:
            return await loop.run_in_executor(None, self.groups.engine_for, spec)
        except asyncio.CancelledError:
            self.groups.stop()  # a newer plan: the formation waiting on the worker ends
            raise

    def _leave_group(self) -> None:
        if self.groups is not None and self._grouped and self.groups.spec is not None:
            self.groups.stop()
        self._grouped = False
        self.serving = self.engine

    async def unload(self, stage: StageWorker) -> None:
        """Hold nothing: the stage serves no plan, the group (if this holder's) ends, the engine frees its shard."""
        stage.activate(None, None)
        self._leave_group()
        self.held = None
        self.downloader.forget(self.owner)
        await asyncio.get_running_loop().run_in_executor(self.executor, self.engine.unload)

    def close(self) -> None:
        if self.groups is not None and self._grouped:
            self.groups.stop()

    async def _load(self, holding: tuple[str, Shard, int], engine: Engine, plan: Plan) -> None:
        model_key, shard, _ = holding
        model = self.models.loaded(model_key)  # described already (it was planned): no network here
        started = time.monotonic()
        # A load replaces what the engine holds from its first step. Forget the old range now: if a newer plan
        # cancels this load (and wants the old range back), the engine must load that range again.
        self.held = None
        self.serving = engine
        if model.manifest is not None:  # a hub model: fetch the files this shard needs that are not here yet
            members = {node_id: part for node_id in plan.member_ids if (part := plan.shard_for(node_id)) is not None}
            await self.downloader.ensure(model.manifest, model.path, shard, model.args.tie_word_embeddings,
                                         self.owner, members)
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        try:
            await loop.run_in_executor(self.executor, engine.load, model.path, model.args, shard, cancel)
        except asyncio.CancelledError:
            cancel.set()  # a newer plan replaced this one: the engine thread gives up at its next tensor
            raise
        await loop.run_in_executor(self.executor, engine.place_threads)
        await loop.run_in_executor(self.executor, self._allocate_kv, engine)
        self.held = holding
        log.info("node %s: loaded %s layers [%d, %d)%s on %s %s (%.1f MB) in %.1fs", self.node_id, model.model_id,
                 shard.start_layer, shard.end_layer, "" if shard.tp is None else f" ({shard.tp})",
                 engine.device_name, engine.dtype_name, engine.parameter_bytes() / 1e6, time.monotonic() - started)

    def _allocate_kv(self, engine: Engine) -> None:
        """Engine thread, after a load: the KV pool for this node's layers, within the budget."""
        args, limits = engine.args, self.limits.for_device(engine.on_cpu)
        size = pool_sizes(kv_budget_bytes(self.kv_cache_gb), engine.kv_block_bytes(), args.kv_window,
                          limits.max_running, limits.max_batch_tokens, args.context_length)
        engine.allocate_kv(size.blocks, size.window_blocks)
