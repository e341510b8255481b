"""Membership: who is in the cluster, and what each member announces.

Every node announces its state to every linked peer on change and every second (PlanState, which doubles as the
heartbeat): its copy of the instance registers, each instance as it holds it, its load, its speed figures and the
peers it is linked with. What to announce, and what to do with a peer's announcement, is the instances' business
(exo_like/instances/): this module keeps the members, their last announcements, and which membership is settled
(settled.py: plans are made only over a membership every member sees).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Callable

from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from exo_like.cluster.peers import PeerNetwork
from exo_like.cluster.protocol import MAX_MEMBERS, InstanceState, PlanState, Wish
from exo_like.cluster.settled import meshed, unsettled
from partitioning.speed_figures import SpeedFigures

log = logging.getLogger(__name__)

ANNOUNCE_INTERVAL = 1.0
ACTIVITY_POLL_SECONDS = 0.2  # a node that starts or stops work says so this soon, so dashboards agree
DEPARTED_SHOWN_SECONDS = 10.0  # a lost node stays listed as unreachable this long, so users see what vanished


@dataclass(frozen=True)
class Announcement:
    wishes: tuple[Wish, ...] = ()
    instances: dict[str, InstanceState] = field(default_factory=dict)  # by instance key
    load: NodeLoad = field(default_factory=NodeLoad)
    figures: dict[str | None, SpeedFigures] = field(default_factory=dict)  # by model (None: links only)
    linked: frozenset[str] = frozenset()  # the peers it is linked with

    def instance(self, key: str) -> InstanceState | None:
        return self.instances.get(key)

    def figures_for(self, model: str | None) -> SpeedFigures | None:
        """Its figures for `model`, or (placing by memory, or not measured yet) its links' alone."""
        return self.figures.get(model) or next(iter(self.figures.values()), None)

    def to_message(self) -> PlanState:
        return PlanState(self.wishes, tuple(self.instances.values()), self.load.to_json(),
                         tuple(f.to_json() for f in self.figures.values()), tuple(sorted(self.linked))[:MAX_MEMBERS])

    @classmethod
    def from_message(cls, message: PlanState) -> "Announcement":
        figures = [SpeedFigures.from_json(f) for f in message.figures]
        return cls(message.wishes, {i.key: i for i in message.instances}, NodeLoad.from_json(message.load),
                   {f.model: f for f in figures}, frozenset(message.linked))


class Cluster:
    """`state`: what this node announces now, its links aside (the instances compose it); `on_announcement`: a
    peer's announcement arrived (its node id, the one before it or None); `on_members`: the live members changed."""

    def __init__(self, me: NodeInfo, peers: PeerNetwork, current_load: Callable[[], NodeLoad] = NodeLoad):
        self.me = me
        self.peers = peers
        self._current_load = current_load
        self.state: Callable[[NodeLoad], Announcement] = lambda load: Announcement(load=load)
        self.on_announcement: Callable[[str, Announcement | None], None] = lambda node_id, before: None
        self.on_members: Callable[[set[str]], None] = lambda live: None
        self.announcements: dict[str, Announcement] = {}
        self._watchers = asyncio.Event()  # replaced after each change: wakes every wait_change() at once
        self._known: dict[str, NodeInfo] = {me.node_id: me}  # members at the last membership change
        self.departed: dict[str, tuple[NodeInfo, float]] = {}  # lost members and when (monotonic)
        self._announced: tuple[float, Announcement | None] = (0.0, None)  # when, and what
        self._announcer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones

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
        if self._announcer is not None:
            self._announcer.cancel()

    def links_changed(self) -> None:
        live = self.member_ids()
        for node_id in list(self.announcements):
            if node_id not in live:
                del self.announcements[node_id]
        self._track_departures()
        self.on_members(live)
        self.announce_soon()

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

    def unsettled(self) -> str | None:
        """Why this node's view of the members is not one they all see yet (None: it is; see settled.py)."""
        return unsettled(self.me.node_id, self.linked_ids(), self._announced_links())

    def meshed(self, nodes: Collection[str]) -> bool:
        """Whether every two of `nodes` are still linked with each other, as far as this node knows."""
        return meshed(nodes, self.me.node_id, self.linked_ids(), self._announced_links())

    def _announced_links(self) -> dict[str, frozenset[str]]:
        return {node_id: announcement.linked for node_id, announcement in self.announcements.items()}

    # -- announcements ----------------------------------------------------------------------------------

    def my_announcement(self) -> Announcement:
        announcement = self.state(self._current_load())
        return Announcement(announcement.wishes, announcement.instances, announcement.load, announcement.figures,
                            frozenset(self.linked_ids()))

    def announcement_of(self, node_id: str) -> Announcement | None:
        return self.my_announcement() if node_id == self.me.node_id else self.announcements.get(node_id)

    def receive(self, node_id: str, message: PlanState) -> None:
        """A peer's announcement (fields checked by protocol.decode)."""
        before = self.announcements.get(node_id)
        self.announcements[node_id] = Announcement.from_message(message)
        self.on_announcement(node_id, before)
        self.notify()

    def notify(self) -> None:
        """Wake every wait_change() (the dashboards' long polls, requests waiting for an instance)."""
        self._watchers.set()
        self._watchers = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        """Return at the next change of membership, plan or any member's announcement, or after `timeout`."""
        try:
            await asyncio.wait_for(self._watchers.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def announce_soon(self) -> None:
        self.notify()
        task = asyncio.ensure_future(self._announce())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _announce(self) -> None:
        mine = self.my_announcement()
        self._announced = (time.monotonic(), mine)
        message = mine.to_message()
        for link in list(self.peers.links.values()):
            try:
                await link.send(message)
            except (ConnectionError, OSError):
                pass  # the link's loss triggers its own re-plan

    async def _announce_forever(self) -> None:
        """Every ANNOUNCE_INTERVAL, and at once when what this node would say changed (it started or stopped
        serving or computing, a measurement ended, a link's round trip moved to another bucket)."""
        while True:
            await asyncio.sleep(ACTIVITY_POLL_SECONDS)
            at, said = self._announced
            mine = self.my_announcement()
            if said is None or _changed(said, mine):
                self.on_announcement(self.me.node_id, said)
                await self._announce()
                self.notify()  # also wakes this node's own dashboards
            elif time.monotonic() - at >= ANNOUNCE_INTERVAL:
                await self._announce()


def _changed(said: Announcement, now: Announcement) -> bool:
    """Whether an announcement says something the last one did not, beyond its ever-moving rates."""
    return (said.figures != now.figures or said.wishes != now.wishes
            or _steady(said.instances) != _steady(now.instances)
            or (said.load.in_flight, said.load.busy) != (now.load.in_flight, now.load.busy))


def _steady(instances: dict[str, InstanceState]) -> dict[str, InstanceState]:
    """The instances without what counts up by itself (how long ago a request ran): said every second anyway."""
    return {model: replace(state, idle_seconds=None) for model, state in instances.items()}
