"""One instance: a model the cluster serves, its agreed plan over some of the nodes, and this node's part in it.

Every node places every instance from the same replicated state (manager.py); each then announces the plan's
digest it arrived at. An instance's plan is agreed when every member it was made from announces the same digest,
and ready once every stage has loaded its shard. A node reloads only when its own range changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from exo_like.cluster.membership import ANNOUNCE_INTERVAL, Cluster
from exo_like.cluster.protocol import InstanceState
from exo_like.engines.work import KVPoolSize
from exo_like.errors import ExoLikeError, ModelLoadingError, ServiceUnavailableError
from exo_like.models.hub.progress import DownloadStatus
from exo_like.models.shard import Shard
from exo_like.serving.ring_generator import RingGenerator
from exo_like.serving.stage import RingResources, StageWorker
from partitioning.decision import PlacementReport
from partitioning.plan import Plan

log = logging.getLogger(__name__)

PLAN_WAIT_SECONDS = 30.0
# A model's first load (its files fetched, its layers loaded on every node of its plan): a streamed request waits for
# it this long, its connection open; a non-streamed one this long, then a 503 with Retry-After (the load goes on).
LOAD_WAIT_SECONDS = 1800.0
NON_STREAMED_LOAD_WAIT_SECONDS = 120.0
RETRY_AFTER_SECONDS = 10


class Part(Protocol):
    """This node's part of an instance (runtime.py): holds a plan's shard and serves it (its stage), and runs this
    node's clients' requests for the model (its generator)."""

    stage: StageWorker
    generator: RingGenerator

    async def hold(self, plan: Plan, shard: Shard | None) -> None: ...

    def kv_size(self) -> KVPoolSize | None: ...

    async def close(self, reason: str, code: str) -> None: ...


class Instance:
    def __init__(self, model: str, cluster: Cluster, make_part: Callable[["Instance"], Part],
                 on_change: Callable[[], None], key: str = ""):
        self.model = model
        self.key = key or model  # its register's key: the model's, or "<model>#<n>" for another instance of it
        self.cluster = cluster
        self._on_change = on_change  # announce: this node's state of the instance changed
        self.plan: Plan | None = None
        self.problem: str | None = None
        self.pending: str | None = None  # why there is no plan yet although the model is asked for (no problem)
        self.placement: PlacementReport | None = None  # why the plan is what it is (GET /v1/cluster)
        self.loaded_digest: str | None = None
        self.digests: list[str] = []  # this instance's plans on this node, newest last (messages are routed by them)
        self.plan_wait_seconds = PLAN_WAIT_SECONDS  # a re-formed ring (--request-wait)
        self.load_wait_seconds = LOAD_WAIT_SECONDS  # its first load
        self.ever_ready = False  # whether it was ready once: a wait after that is for a re-formed ring
        self._load_task: asyncio.Task | None = None
        self._stopped = False
        self._changed = asyncio.Event()
        self.part = make_part(self)

    @property
    def me(self) -> str:
        return self.cluster.me.node_id

    # -- the plan -----------------------------------------------------------------------------------------

    def settle(self, plan: Plan | None, problem: str | None, pending: str | None,
               placement: PlacementReport | None) -> None:
        """The plan placement arrived at (or why there is none); this node loads its part when the plan changed."""
        self.pending, self.placement = pending, placement
        if plan == self.plan and problem == self.problem:
            return
        if plan is not None and (self.plan is None or plan.digest != self.plan.digest):
            log.info("node %s: plan %s for %s: %s%s", self.me, plan.digest, plan.model_id,
                     ", ".join(f"{s.node_id}[{s.start_layer},{s.end_layer})" for s in plan.stages),
                     f"; {placement.describe()}" if placement else "")
            self.digests = [*self.digests[-7:], plan.digest]
        self.plan, self.problem = plan, problem
        if problem:
            log.warning("node %s: %s", self.me, problem)
        self._start_loading()
        self.changed()

    def reload(self) -> None:
        """Hold the plan's shard again, announcing not ready until done: this node's group worker exited, and the
        group forms anew (a plan that did not change would otherwise keep it as it was)."""
        self.loaded_digest = None
        self._start_loading()
        self.changed()

    def _start_loading(self) -> None:
        plan = self.plan
        if plan is None or self.problem or self._stopped:
            return
        if self._load_task is not None:
            self._load_task.cancel()
        self._load_task = asyncio.ensure_future(self._load(plan, plan.shard_for(self.me)))

    async def _load(self, plan: Plan, shard: Shard | None) -> None:
        try:
            await self.part.hold(plan, shard)
        except ExoLikeError as exc:
            self.problem = f"node {self.me} cannot load {shard}: {exc.message}"
            log.error("node %s: %s", self.me, self.problem)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a load failure must be visible to every node, not kill this one
            log.exception("node %s: loading %s failed", self.me, shard)
            self.problem = f"node {self.me} failed to load {shard}: {exc}"
        else:
            if self.plan is not None and self.plan.digest == plan.digest:
                self.loaded_digest = plan.digest
        self.changed()

    def stop(self) -> None:
        """The instance is unloaded (or the node stops): no load from here on."""
        self._stopped = True
        if self._load_task is not None:
            self._load_task.cancel()

    def changed(self) -> None:
        """This node's state of the instance changed: wake its waiting requests, and announce."""
        self.wake()
        self._on_change()

    def wake(self) -> None:
        """Look again whether the instance is ready (a member announced something)."""
        self._changed.set()

    # -- agreement ----------------------------------------------------------------------------------------

    def state(self, in_flight: int = 0, keep_alive: float | None = None, idle_seconds: float | None = None,
              pinned: bool = False) -> InstanceState:
        """This node's state of the instance, as it announces it (its use of it as the instances say)."""
        digest = self.plan.digest if self.plan else None
        ready = self.is_loaded()
        kv = self.part.kv_size() if ready else None
        return InstanceState(self.model, digest, ready, self.problem, kv.blocks if kv else None,
                             kv.window_blocks if kv else None, in_flight, keep_alive, idle_seconds, pinned,
                             "" if self.key == self.model else self.key)

    def is_loaded(self) -> bool:
        return self.plan is not None and self.loaded_digest == self.plan.digest

    def state_of(self, node_id: str) -> InstanceState | None:
        """A member's announced state of this instance (this node's: as it holds it)."""
        if node_id == self.me:
            return self.state()
        announcement = self.cluster.announcements.get(node_id)
        return announcement.instance(self.key) if announcement is not None else None

    def _plan_members(self) -> set[str]:
        """The live members the plan was made from, other than this node: those that must announce its digest.
        (Every member, except ones still measuring their speed while a ring goes on without them.)"""
        made_from = {node_id for node_id, _ in self.plan.memories} if self.plan else set()
        return (self.cluster.member_ids() & made_from) - {self.me}

    @property
    def agreed(self) -> bool:
        if self.plan is None:
            return False
        return all((state := self.state_of(n)) is not None and state.digest == self.plan.digest
                   for n in self._plan_members())

    @property
    def ready(self) -> bool:
        if not self.agreed or self.problem or self.plan is None:
            return False
        return all((state := self.state_of(n)) is not None and state.ready for n in self.plan.member_ids)

    def peer_problem(self) -> str | None:
        """A problem a member of the cluster announced for this instance (a node that cannot load its part)."""
        for announcement in self.cluster.announcements.values():
            state = announcement.instance(self.key)
            if state is not None and state.problem:
                return state.problem
        return None

    def why_not_ready(self) -> str:
        if self.problem:
            return self.problem
        if self.plan is None:
            return self.pending or "no plan yet"
        waiting = [n for n in self._plan_members()
                   if (state := self.state_of(n)) is None or state.digest != self.plan.digest]
        if waiting:
            return f"nodes {', '.join(sorted(waiting))} have not agreed on plan {self.plan.digest} yet"
        loading = [n for n in self.plan.member_ids if not ((state := self.state_of(n)) and state.ready)]
        downloads = [f"node {n}: {status.describe()}" for n in loading
                     if (status := self._download_of(n)) is not None and status.state == "downloading"]
        return f"nodes {', '.join(loading)} are still loading their layers" + "".join(f"; {d}" for d in downloads)

    def _download_of(self, node_id: str) -> DownloadStatus | None:
        announcement = self.cluster.announcement_of(node_id)
        return announcement.load.download if announcement is not None else None

    def ring_resources(self, plan: Plan) -> RingResources | None:
        """What the plan's first stage may use: the smallest KV pool among the plan's members (None until each has
        announced one; a tensor-parallel group's followers hold the same blocks as their leader), and how many
        batches to keep in flight (one per machine the stages run on)."""
        states = [self.state_of(node_id) for node_id in plan.member_ids]
        pools = [state.kv_size if state is not None and state.digest == plan.digest else None for state in states]
        if any(pool is None for pool in pools):
            return None
        hosts = {m.host for m in self.cluster.members() if m.node_id in plan.node_ids}
        windows = [pool.window_blocks for pool in pools if pool.window_blocks is not None]  # type: ignore[union-attr]
        return RingResources(min(pool.blocks for pool in pools), max(1, len(hosts)),  # type: ignore[union-attr]
                             min(windows, default=None))

    async def wait_ready(self, timeout: float | None = None) -> Plan:
        """The plan once the instance is ready. Default timeout: its first load's, else a re-formed ring's."""
        limit = timeout if timeout is not None else \
            self.plan_wait_seconds if self.ever_ready else max(self.plan_wait_seconds, self.load_wait_seconds)
        try:
            return await self._wait(limit)
        except TimeoutError:
            raise ServiceUnavailableError(f"no agreed plan for {self.model} after {limit:.0f}s: "
                                          f"{self.why_not_ready()}", code="plan_unavailable") from None

    async def wait_loaded(self) -> None:
        """Wait for the instance's first load as long as a non-streamed request may (at most --request-wait, where
        set); then a 503 that asks the client to come back (the load goes on meanwhile)."""
        limit = min(NON_STREAMED_LOAD_WAIT_SECONDS, self.load_wait_seconds)
        try:
            await self._wait(limit)
        except TimeoutError:
            raise ModelLoadingError(f"{self.model} is still loading after {limit:.0f}s ({self.why_not_ready()}); "
                                    "it goes on loading: retry shortly, or stream the request to wait for it",
                                    RETRY_AFTER_SECONDS) from None

    async def _wait(self, limit: float) -> Plan:
        deadline = time.monotonic() + limit
        while not self.ready:
            problem = self.problem or self.peer_problem()
            if problem:
                raise ServiceUnavailableError(problem, code="plan_unavailable")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, ANNOUNCE_INTERVAL))
            except asyncio.TimeoutError:
                pass
        assert self.plan is not None
        self.ever_ready = True
        return self.plan

    def node_status(self, node_id: str) -> str:
        if self.plan is None:
            return "joining"
        state = self.state_of(node_id)
        if state is None or state.digest != self.plan.digest:
            return "joining"
        return "ready" if state.ready else "loading"
