"""This node's part of the model: hold the agreed plan's layer range on the engine, then let the stage serve it.

Holding a range means fetching the files it needs (a hub model), loading it on the engine thread, and sizing the
KV pool within the budget. A range already held is not loaded again. A newer plan cancels a load under way: the
engine thread gives up at its next tensor, and the range is forgotten so that a plan wanting it back loads it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from exo_like.engines.base import Engine
from exo_like.models.hub.download import ShardDownloader
from exo_like.models.registry import ModelRegistry
from exo_like.models.shard import Shard
from exo_like.serving.kv_blocks import kv_budget_bytes, pool_sizes
from exo_like.serving.scheduler import SchedulerLimits
from exo_like.serving.stage import StageWorker
from partitioning.plan import Plan

log = logging.getLogger(__name__)


class ShardHolder:
    def __init__(self, node_id: str, engine: Engine, executor: ThreadPoolExecutor, models: ModelRegistry,
                 downloader: ShardDownloader, kv_cache_gb: float | None, limits: SchedulerLimits):
        self.node_id = node_id
        self.engine = engine
        self.executor = executor
        self.models = models
        self.downloader = downloader
        self.kv_cache_gb = kv_cache_gb
        self.limits = limits  # the scheduler's, should this node be a first stage (they size the window pool)
        self.held: tuple[str, Shard] | None = None  # (model key, shard) the engine holds

    async def hold(self, plan: Plan, shard: Shard | None, stage: StageWorker) -> None:
        """Hold this plan's shard (reloading only if the range changed), then let the stage serve the plan."""
        if shard is None:
            stage.activate(plan, None)
            return
        if self.held != (plan.model_id, shard):
            stage.activate(None, None)
            await self._load(plan.model_id, shard)
        stage.activate(plan, self.engine)

    async def _load(self, model_key: str, shard: Shard) -> None:
        model = self.models.loaded(model_key)  # described already (it was planned): no network here
        started = time.monotonic()
        # A load replaces what the engine holds from its first step. Forget the old range now: if a newer plan
        # cancels this load (and wants the old range back), the engine must load that range again.
        self.held = None
        if model.manifest is not None:  # a hub model: fetch the files this shard needs that are not here yet
            await self.downloader.ensure(model.manifest, model.path, shard, model.args.tie_word_embeddings)
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        try:
            await loop.run_in_executor(self.executor, self.engine.load, model.path, model.args, shard, cancel)
        except asyncio.CancelledError:
            cancel.set()  # a newer plan replaced this one: the engine thread gives up at its next tensor
            raise
        await loop.run_in_executor(self.executor, self.engine.place_threads)
        await loop.run_in_executor(self.executor, self._allocate_kv)
        self.held = (model_key, shard)
        log.info("node %s: loaded %s layers [%d, %d) on %s %s (%.1f MB) in %.1fs", self.node_id, model.model_id,
                 shard.start_layer, shard.end_layer, self.engine.device_name, self.engine.dtype_name,
                 self.engine.parameter_bytes() / 1e6, time.monotonic() - started)

    def _allocate_kv(self) -> None:
        """Engine thread, after a load: the KV pool for this node's layers, within the budget."""
        args, limits = self.engine.args, self.limits.for_device(self.engine.on_cpu)
        size = pool_sizes(kv_budget_bytes(self.kv_cache_gb), self.engine.kv_block_bytes(), args.kv_window,
                          limits.max_running, limits.max_batch_tokens, args.context_length)
        self.engine.allocate_kv(size.blocks, size.window_blocks)
