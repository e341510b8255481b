"""Membership and plan agreement.

Every node computes the plan from its own view (itself plus its linked peers) and announces the plan's digest
to all peers, with the peers it is linked with. It makes a new plan only once that view is one every member sees
(membership.py): while a joining node is linked with some members only, the plan in place stands or there is
none. A plan is agreed only when every member announces the same digest, and ready once every stage
has loaded its shard. Membership changes re-plan; a node reloads only when its own range changed.

Which model the cluster serves is cluster state too: `--model` or the first request sets it with a Lamport
clock, and the newest setting wins everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.peers import PeerNetwork
from exo_like.cluster.protocol import MAX_MEMBERS, PlanState
from exo_like.cluster.settled import meshed, unsettled
from exo_like.engines.work import KVPoolSize
from exo_like.errors import ExoLikeError, ModelPendingError, ServiceUnavailableError
from exo_like.models.footprint import ModelDescription
from exo_like.models.hub.progress import DownloadStatus
from exo_like.models.shard import Shard
from partitioning.decision import PlacementReport, Placer
from partitioning.plan import Plan
from partitioning.speed_figures import SpeedFigures, SpeedSource

log = logging.getLogger(__name__)

ANNOUNCE_INTERVAL = 1.0
PLAN_WAIT_SECONDS = 30.0
ACTIVITY_POLL_SECONDS = 0.2  # a node that starts or stops work says so this soon, so dashboards agree


@dataclass(frozen=True)
class RingResources:
    kv_blocks: int  # the smallest KV pool of the plan's stages: what the first stage may hand out
    pipeline_depth: int  # batches worth keeping in flight (stages on separate machines)
    kv_window_blocks: int | None = None  # the same for the sliding-window layers' pools (None: the model has none)


DEPARTED_SHOWN_SECONDS = 10.0  # a lost node stays listed as unreachable this long, so users see what vanished


@dataclass(frozen=True)
class Announcement:
    model: str | None
    clock: tuple[int, str]
    digest: str | None
    ready: bool
    problem: str | None
    load: NodeLoad = field(default_factory=NodeLoad)
    kv: KVPoolSize | None = None  # the KV pool the node holds for its layers (None: not loaded, or not said)
    figures: SpeedFigures | None = None  # its placement, measured speed and link round trips (None: not said)
    linked: frozenset[str] = frozenset()  # the peers it is linked with


class Cluster:
    def __init__(self, me: NodeInfo, peers: PeerNetwork, describe: Callable[[str], ModelDescription],
                 load_shard: Callable[[Plan, Shard | None], Awaitable[None]],
                 on_members: Callable[[set[str]], None], current_load: Callable[[], NodeLoad] = NodeLoad,
                 kv_size: Callable[[], KVPoolSize | None] = lambda: None, speed: SpeedSource | None = None):
        self.me = me
        self.peers = peers
        self._describe = describe
        self._load_shard = load_shard
        self._on_members = on_members
        self._current_load = current_load
        self._kv_size = kv_size  # this node's KV pool, announced with `ready` (the first stage sizes by it)
        self._speed = speed or SpeedSource()
        self._placer = Placer(me.node_id)
        self.placement: PlacementReport | None = None  # why the plan is what it is (GET /v1/cluster)
        self.model_id: str | None = None
        self.clock: tuple[int, str] = (0, "")
        self.plan: Plan | None = None
        self.problem: str | None = None
        self.pending: str | None = None  # why there is no plan yet although a model is set (not a problem)
        self.loaded_digest: str | None = None
        self.announcements: dict[str, Announcement] = {}
        self._changed = asyncio.Event()
        self._watchers = asyncio.Event()  # replaced after each change: wakes every wait_change() at once
        self._known: dict[str, NodeInfo] = {me.node_id: me}  # members at the last membership change
        self.departed: dict[str, tuple[NodeInfo, float]] = {}  # lost members and when (monotonic)
        self._announced: tuple[float, int, bool] = (0.0, 0, False)  # when, and the in-flight/busy it said
        self._announced_figures: SpeedFigures | None = None
        self._load_task: asyncio.Task | None = None
        self._announcer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones
        self.plan_wait_seconds = PLAN_WAIT_SECONDS
        self.unsettled: str | None = None  # why this node's view of the members is not one they all see yet

    # -- membership -------------------------------------------------------------------------------------

    def members(self) -> list[NodeInfo]:
        return [self.me] + [link.remote for link in self.peers.links.values() if not link.closed]

    def member_ids(self) -> set[str]:
        return {m.node_id for m in self.members()}

    def linked_ids(self) -> set[str]:
        """The members other than this node: the peers it is linked with."""
        return self.member_ids() - {self.me.node_id}

    def name_of(self, node_id: str) -> str:
        """A node's name: a member's, or a departed one's (errors about a lost node name it)."""
        for member in self.members():
            if member.node_id == node_id:
                return member.name
        departed = self.departed.get(node_id)
        return departed[0].name if departed is not None else node_id

    def start(self) -> None:
        self._announcer = asyncio.ensure_future(self._announce_forever())

    async def stop(self) -> None:
        for task in (self._announcer, self._load_task):
            if task is not None:
                task.cancel()

    def links_changed(self) -> None:
        live = self.member_ids()
        for node_id in list(self.announcements):
            if node_id not in live:
                del self.announcements[node_id]
        self._track_departures()
        self._on_members(live)
        self.replan()

    def _track_departures(self) -> None:
        now = time.monotonic()
        members = {m.node_id: m for m in self.members()}
        for node_id, info in self._known.items():
            if node_id not in members:
                self.departed[node_id] = (info, now)
        for node_id in list(self.departed):
            if node_id in members or now - self.departed[node_id][1] > DEPARTED_SHOWN_SECONDS:
                del self.departed[node_id]
        self._known = members

    # -- model and plan ---------------------------------------------------------------------------------

    def set_model(self, model_id: str) -> None:
        """Make the cluster serve `model_id` (newest setting wins on every node)."""
        if model_id == self.model_id:
            return
        self.clock = (self.clock[0] + 1, self.me.node_id)
        self.model_id = model_id
        log.info("node %s: cluster model set to %s", self.me.node_id, model_id)
        self.replan()

    def replan(self) -> None:
        self._check_membership()
        if self.unsettled is not None and self._plan_still_meshed():
            self._announce_soon()  # the ring in place goes on while the new member links with everyone
            return
        plan, problem = self._compute_plan() if self.unsettled is None else self._no_plan_until_settled()
        if plan != self.plan or problem != self.problem:
            if plan is not None and (self.plan is None or plan.digest != self.plan.digest):
                log.info("node %s: plan %s for %s: %s%s", self.me.node_id, plan.digest, plan.model_id,
                         ", ".join(f"{s.node_id}[{s.start_layer},{s.end_layer})" for s in plan.stages),
                         f"; {self.placement.describe()}" if self.placement else "")
            self.plan, self.problem = plan, problem
            if problem:
                log.warning("node %s: %s", self.me.node_id, problem)
            self._start_loading()
        self._announce_soon()

    def _compute_plan(self) -> tuple[Plan | None, str | None]:
        self.pending, self.placement = None, None
        if self.model_id is None:
            return None, None
        try:
            description = self._describe(self.model_id)
        except ModelPendingError as exc:
            self.pending = exc.message  # the node re-plans once it has the description
            return None, None
        except ExoLikeError as exc:
            return None, f"cannot serve {self.model_id}: {exc.message}"
        figures = {node_id: self.figures_of(node_id) for node_id in self.member_ids()}
        # Slices for tensor-parallel groups only once every member has its layer figure: nodes of one host measure
        # one at a time, and the plan waits for those figures, not for the slices.
        everyone = all(f is not None and f.measured_for(self.model_id) for f in figures.values())
        same_engine = sum(m.engine == self.me.engine for m in self.members()) if everyone else 1
        self._speed.measure(self.model_id, same_engine)  # a no-op once measured (or when placing by memory)
        figures[self.me.node_id] = self.figures_of(self.me.node_id)
        decision = self._placer.decide(self.model_id, description.n_layers, description.footprint, self.members(),
                                       figures, self.plan, description.tensor_sizes, description.tensor_engines)
        self.pending, self.placement = decision.pending, decision.report
        return decision.plan, decision.problem

    def _check_membership(self) -> None:
        """Note whether some linked peer is linked with other members than this node is (see membership.py)."""
        before = self.unsettled
        self.unsettled = unsettled(self.me.node_id, self.linked_ids(), self._announced_links()) \
            if self.model_id is not None else None
        if self.unsettled != before:
            if self.unsettled is None:
                log.info("node %s: every member is linked with every other", self.me.node_id)
            else:
                log.info("node %s: waiting for the members to link with each other: %s", self.me.node_id,
                         self.unsettled)

    def _plan_still_meshed(self) -> bool:
        """Whether the plan in place serves this model and its stages are all still linked with each other."""
        if self.plan is None or self.plan.model_id != self.model_id:
            return False
        return meshed(self.plan.member_ids, self.me.node_id, self.linked_ids(), self._announced_links())

    def _announced_links(self) -> dict[str, frozenset[str]]:
        return {node_id: announcement.linked for node_id, announcement in self.announcements.items()}

    def _no_plan_until_settled(self) -> tuple[None, None]:
        self.placement = None
        self.pending = f"waiting for the members to link with each other ({self.unsettled})"
        return None, None

    def figures_of(self, node_id: str) -> SpeedFigures | None:
        """A member's figures as announced (this node's: as it announces them)."""
        if node_id == self.me.node_id:
            return self._speed.figures(self.model_id)
        announcement = self.announcements.get(node_id)
        return announcement.figures if announcement is not None else None

    def reload(self) -> None:
        """Hold the plan's shard again, announcing not ready until done: this node's group worker exited, and the
        group forms anew (a plan that did not change would otherwise keep it as it was)."""
        self.loaded_digest = None
        self._start_loading()
        self._announce_soon()

    def _start_loading(self) -> None:
        """Ask the node to hold this plan's shard; it reloads only if its range changed."""
        plan = self.plan
        if plan is None or self.problem:
            return
        if self._load_task is not None:
            self._load_task.cancel()
        self._load_task = asyncio.ensure_future(self._load(plan, plan.shard_for(self.me.node_id)))

    async def _load(self, plan: Plan, shard: Shard | None) -> None:
        try:
            await self._load_shard(plan, shard)
        except ExoLikeError as exc:
            self.problem = f"node {self.me.node_id} cannot load {shard}: {exc.message}"
            log.error("node %s: %s", self.me.node_id, self.problem)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a load failure must be visible to every node, not kill this one
            log.exception("node %s: loading %s failed", self.me.node_id, shard)
            self.problem = f"node {self.me.node_id} failed to load {shard}: {exc}"
        else:
            if self.plan is not None and self.plan.digest == plan.digest:
                self.loaded_digest = plan.digest
        self._announce_soon()

    # -- agreement --------------------------------------------------------------------------------------

    def my_announcement(self) -> Announcement:
        digest = self.plan.digest if self.plan else None
        ready = digest is not None and self.loaded_digest == digest
        return Announcement(self.model_id, self.clock, digest, ready, self.problem, self._current_load(),
                            self._kv_size() if ready else None, self._speed.figures(self.model_id),
                            frozenset(self.linked_ids()))

    def receive(self, node_id: str, message: PlanState) -> None:
        """A peer's announcement (fields checked by protocol.decode)."""
        figures = SpeedFigures.from_json(message.figures) if message.figures is not None else None
        announcement = Announcement(message.model, message.clock, message.digest, message.ready, message.problem,
                                    NodeLoad.from_json(message.load), message.kv_size, figures,
                                    frozenset(message.linked))
        before = self.announcements.get(node_id)
        self.announcements[node_id] = announcement
        if announcement.model is not None and message.clock > self.clock:
            self.clock, self.model_id = message.clock, announcement.model
            log.info("node %s: adopting model %s from %s", self.me.node_id, announcement.model, node_id)
            self.replan()
        elif before is None or before.figures != figures or before.linked != announcement.linked:
            self.replan()  # the plan is made from every member's announced figures and links
        self._notify()

    def _plan_members(self) -> set[str]:
        """The live members the plan was made from, other than this node: those that must announce its digest.
        (Every member, except ones still measuring their speed while a ring goes on without them.)"""
        made_from = {node_id for node_id, _ in self.plan.memories} if self.plan else set()
        return (self.member_ids() & made_from) - {self.me.node_id}

    @property
    def agreed(self) -> bool:
        if self.plan is None:
            return False
        return all(node_id in self.announcements and self.announcements[node_id].digest == self.plan.digest
                   for node_id in self._plan_members())

    @property
    def ready(self) -> bool:
        if not self.agreed or self.problem or self.plan is None:
            return False
        mine = self.my_announcement()
        return mine.ready and all(self.announcements[n].ready for n in self.plan.member_ids if n != self.me.node_id)

    def why_not_ready(self) -> str:
        if self.model_id is None:
            return "no model selected"
        if self.problem:
            return self.problem
        if self.plan is None:
            return self.pending or "no plan yet"
        waiting = [n for n in self._plan_members()
                   if self.announcements.get(n) is None or self.announcements[n].digest != self.plan.digest]
        if waiting:
            return f"nodes {', '.join(sorted(waiting))} have not agreed on plan {self.plan.digest} yet"
        loading = [n for n in self.plan.member_ids if n == self.me.node_id and not self.my_announcement().ready
                   or n != self.me.node_id and not self.announcements[n].ready]
        downloads = [f"node {n}: {status.describe()}" for n in loading
                     if (status := self._download_of(n)) is not None and status.state == "downloading"]
        return f"nodes {', '.join(loading)} are still loading their layers" + "".join(f"; {d}" for d in downloads)

    def ring_resources(self, plan: Plan) -> RingResources | None:
        """What the plan's first stage may use: the smallest KV pool among the plan's members (None until each has
        announced one; a tensor-parallel group's followers hold the same blocks as their leader), and how many
        batches to keep in flight (one per machine the stages run on)."""
        pools = [self._kv_size() if node_id == self.me.node_id else
                 getattr(self.announcements.get(node_id), "kv", None) for node_id in plan.member_ids]
        if any(pool is None for pool in pools):
            return None
        hosts = {m.host for m in self.members() if m.node_id in plan.node_ids}
        windows = [pool.window_blocks for pool in pools if pool.window_blocks is not None]
        return RingResources(min(pool.blocks for pool in pools), max(1, len(hosts)), min(windows, default=None))

    def _download_of(self, node_id: str) -> DownloadStatus | None:
        announcement = self.announcement_of(node_id)
        return announcement.load.download if announcement is not None else None

    async def wait_ready(self, timeout: float | None = None) -> Plan:
        deadline = time.monotonic() + (self.plan_wait_seconds if timeout is None else timeout)
        while not self.ready:
            peer_problems = [a.problem for a in self.announcements.values() if a.problem]
            if self.problem or peer_problems:
                raise ServiceUnavailableError(self.problem or str(peer_problems[0]), code="plan_unavailable")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceUnavailableError(f"no agreed plan after {self.plan_wait_seconds:.0f}s: "
                                              f"{self.why_not_ready()}", code="plan_unavailable")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, ANNOUNCE_INTERVAL))
            except asyncio.TimeoutError:
                pass
        assert self.plan is not None
        return self.plan

    def _notify(self) -> None:
        self._changed.set()
        self._watchers.set()
        self._watchers = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        """Return at the next change of membership, plan or any member's announcement, or after `timeout`."""
        try:
            await asyncio.wait_for(self._watchers.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _announce_soon(self) -> None:
        self._notify()
        task = asyncio.ensure_future(self._announce())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _announce(self) -> None:
        mine = self.my_announcement()
        self._announced, self._announced_figures = (time.monotonic(), mine.load.in_flight, mine.load.busy), mine.figures
        message = PlanState(mine.model, mine.clock, mine.digest, mine.ready, mine.problem, mine.load.to_json(),
                            kv_blocks=mine.kv.blocks if mine.kv else None,
                            kv_window_blocks=mine.kv.window_blocks if mine.kv else None,
                            figures=mine.figures.to_json() if mine.figures else None,
                            linked=tuple(sorted(mine.linked))[:MAX_MEMBERS])
        for link in list(self.peers.links.values()):
            try:
                await link.send(message)
            except (ConnectionError, OSError):
                pass  # the link's loss triggers its own re-plan

    async def _announce_forever(self) -> None:
        """Every ANNOUNCE_INTERVAL, and at once when this node starts or stops serving or computing."""
        while True:
            await asyncio.sleep(ACTIVITY_POLL_SECONDS)
            at, in_flight, busy = self._announced
            load = self._current_load()
            if self._speed.figures(self.model_id) != self._announced_figures:
                self.replan()  # a link's round trip moved to another bucket, or a measurement ended
            elif (load.in_flight, load.busy) != (in_flight, busy):
                self._announce_soon()  # also wakes this node's own dashboards
            elif time.monotonic() - at >= ANNOUNCE_INTERVAL:
                await self._announce()

    # -- reporting --------------------------------------------------------------------------------------

    def node_status(self, node_id: str) -> str:
        if self.plan is None:
            return "idle" if self.model_id is None else "joining"
        announcement = self.announcement_of(node_id)
        if announcement is None or announcement.digest != self.plan.digest:
            return "joining"
        return "ready" if announcement.ready else "loading"

    def announcement_of(self, node_id: str) -> Announcement | None:
        return self.my_announcement() if node_id == self.me.node_id else self.announcements.get(node_id)

    def description(self) -> ModelDescription | None:
        """The served model's layer count and bytes, if this node has them."""
        if self.model_id is None:
            return None
        try:
            return self._describe(self.model_id)
        except ExoLikeError:
            return None  # already reported as the cluster's problem
