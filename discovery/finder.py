"""Keeps this node linked to every peer it knows of: static `--peers`, peers seen on mDNS, and peers its linked
peers are linked with (peer exchange, exo_like/peers.py), so that any one member's address is enough to join.

It only decides whom to dial and when; the dialing itself (and the authentication) is a callable from the
transport. Unlinked peers are redialled every few seconds, so a restarted or briefly unreachable peer comes
back without anyone doing anything. mDNS and exchanged peers that stay unreachable are forgotten after a while
(an exchanged address is redialled again only once a peer reports it anew), so an address that answers with
something other than exo-like, or that does not reach the peer from here, is not dialed forever.

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
MAX_EXCHANGED = 256  # peers learned from other peers kept at once: what peers report cannot grow without bound

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
        self._exchanged: dict[str, tuple[PeerAddress, float]] = {}  # the same, for peers learned from peers
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

    def found_by_peer(self, peer: PeerAddress) -> None:
        """A linked peer is linked with `peer` (as `peer` advertises itself): dial it like a static peer."""
        if peer.node_id is None or peer.node_id == self.node_id:
            return
        if peer.node_id not in self._exchanged and len(self._exchanged) >= MAX_EXCHANGED:
            log.warning("node %s: not dialing %s at %s: already %d peers learned from peers", self.node_id,
                        peer.node_id, peer.address, MAX_EXCHANGED)
            return
        self._exchanged[peer.node_id] = (peer, time.monotonic())
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
        attempts += self._dial_known(self._mdns_peers) + self._dial_known(self._exchanged)
        if attempts:
            await asyncio.gather(*attempts, return_exceptions=True)

    def _dial_known(self, peers: dict[str, tuple[PeerAddress, float]]) -> list[Awaitable[str | None]]:
        """Dials of the unlinked peers among `peers` (by node id); forgets those unreachable for too long."""
        attempts = []
        now = time.monotonic()
        for node_id, (peer, seen) in list(peers.items()):
            if self._is_linked(node_id):
                peers[node_id] = (peer, now)
            elif now - seen > FORGET_AFTER_SECONDS:
                log.info("node %s: forgetting %s (unreachable at %s)", self.node_id, node_id, peer.address)
                del peers[node_id]
            else:
                attempts.append(self._dial(peer.host, peer.port))
        return attempts

    async def _dial_static(self, peer: PeerAddress) -> None:
        node_id = await self._dial(peer.host, peer.port)
        if node_id is not None:
            self._static_ids[peer] = node_id
