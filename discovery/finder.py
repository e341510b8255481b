"""Keeps this node linked to every peer it knows of: static `--peers` and peers seen on mDNS.

It only decides whom to dial and when; the dialing itself (and the authentication) is a callable from the
transport. Unlinked peers are redialled every few seconds, so a restarted or briefly unreachable peer comes
back without anyone doing anything. mDNS peers that stay unreachable are forgotten after a while.

Nodes advertising another cluster key are never dialed; while their advertisement lasts, every round reports
them (`report`), so a user who set a key on one machine and not on another sees why they stay apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from discovery.mdns import MdnsDiscovery
from discovery.static import PeerAddress

log = logging.getLogger(__name__)

REDIAL_SECONDS = 2.0
FORGET_AFTER_SECONDS = 60.0

Dial = Callable[[str, int], Awaitable[str | None]]  # (host, port) -> linked node id, or None
Report = Callable[[PeerAddress, str, str], None]  # a peer this node will not link with: (peer, code, reason)

OTHER_CLUSTER = ("in another cluster: it advertises a different cluster key on mDNS, so this node does not dial "
                 "it (set the same --cluster-key or EXO_LIKE_CLUSTER_KEY on every node that should join)")


class PeerFinder:
    def __init__(self, node_id: str, dial: Dial, is_linked: Callable[[str], bool], static_peers: list[PeerAddress],
                 mdns: MdnsDiscovery | None, report: Report = lambda peer, code, reason: None):
        self.node_id = node_id
        self._dial = dial
        self._is_linked = is_linked
        self._static = static_peers
        self._static_ids: dict[PeerAddress, str] = {}
        self._mdns_peers: dict[str, tuple[PeerAddress, float]] = {}  # node id -> (address, last seen)
        self._other_clusters: dict[str, PeerAddress] = {}  # node id -> address, while it advertises
        self._mdns = mdns
        self._report = report
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def found_on_mdns(self, peer: PeerAddress) -> None:
        if peer.node_id is None or peer.node_id == self.node_id:
            return
        self._mdns_peers[peer.node_id] = (peer, time.monotonic())
        self._other_clusters.pop(peer.node_id, None)  # it now advertises our key (restarted with it)
        self._wake.set()

    def found_other_cluster(self, peer: PeerAddress) -> None:
        if peer.node_id is not None:
            self._mdns_peers.pop(peer.node_id, None)  # it now advertises another key: stop dialing it
            self._other_clusters[peer.node_id] = peer
            self._report(peer, "other_cluster", OTHER_CLUSTER)

    def gone_from_mdns(self, node_id: str) -> None:
        self._other_clusters.pop(node_id, None)

    async def start(self) -> None:
        if self._mdns is not None:
            await self._mdns.start()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._mdns is not None:
            await self._mdns.stop()

    async def _run(self) -> None:
        while True:
            await self._dial_unlinked()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), REDIAL_SECONDS)
            except asyncio.TimeoutError:
                pass

    async def _dial_unlinked(self) -> None:
        for peer in self._other_clusters.values():
            self._report(peer, "other_cluster", OTHER_CLUSTER)
        attempts = [self._dial_static(peer) for peer in self._static
                    if not self._is_linked(self._static_ids.get(peer, ""))]
        now = time.monotonic()
        for node_id, (peer, seen) in list(self._mdns_peers.items()):
            if self._is_linked(node_id):
                self._mdns_peers[node_id] = (peer, now)
            elif now - seen > FORGET_AFTER_SECONDS:
                log.info("node %s: forgetting %s (unreachable at %s)", self.node_id, node_id, peer.address)
                del self._mdns_peers[node_id]
            else:
                attempts.append(self._dial(peer.host, peer.port))
        if attempts:
            await asyncio.gather(*attempts, return_exceptions=True)

    async def _dial_static(self, peer: PeerAddress) -> None:
        node_id = await self._dial(peer.host, peer.port)
        if node_id is not None:
            self._static_ids[peer] = node_id
