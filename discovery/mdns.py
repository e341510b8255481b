"""mDNS (zeroconf) registration and browsing of `_exo-like._tcp.local.`.

TXT record: node id, version, port and the cluster key digest, so nodes of another cluster on the same LAN
are ignored before any connection is made. Found peers are reported through a callback; links and their
authentication are the node's business (exo_like.cluster.peers).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

import psutil
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from discovery.static import PeerAddress

log = logging.getLogger(__name__)

SERVICE_TYPE = "_exo-like._tcp.local."
LOOKUP_TIMEOUT_MS = 3000
INSTANCE_PREFIX = "exo-like-"  # a node's service instance is exo-like-<node id>


def local_ipv4_addresses() -> list[str]:
    """Non-loopback IPv4 addresses of this host (or this network namespace)."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                found.append(addr.address)
    return sorted(set(found))


class MdnsDiscovery:
    def __init__(self, node_id: str, port: int, cluster_digest: str, version: str,
                 on_found: Callable[[PeerAddress], None], addresses: list[str] | None = None,
                 on_other_cluster: Callable[[PeerAddress], None] | None = None,
                 on_removed: Callable[[str], None] | None = None):
        self.node_id = node_id
        self.port = port
        self.cluster_digest = cluster_digest
        self.version = version
        self._on_found = on_found
        self._on_other_cluster = on_other_cluster  # nodes seen with another cluster key: not dialed, but reported
        self._other_cluster_ids: set[str] = set()  # logged once each
        self._on_removed = on_removed  # a node's advertisement went away (it said goodbye, or its records expired)
        self._addresses = addresses
        self._zeroconf: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        addresses = self._addresses or local_ipv4_addresses() or ["127.0.0.1"]
        self._zeroconf = AsyncZeroconf(ip_version=IPVersion.V4Only)
        self._info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{INSTANCE_PREFIX}{self.node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addresses],
            port=self.port,
            properties={"id": self.node_id, "v": self.version, "port": str(self.port), "key": self.cluster_digest},
            server=f"exo-like-{self.node_id}.local.",
        )
        await self._zeroconf.async_register_service(self._info)
        self._browser = AsyncServiceBrowser(self._zeroconf.zeroconf, [SERVICE_TYPE], handlers=[self._on_change])
        log.info("node %s: mDNS advertising %s on %s port %d", self.node_id, SERVICE_TYPE, addresses, self.port)

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.ensure_future(self._resolve(zeroconf, service_type, name))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif state_change == ServiceStateChange.Removed and self._on_removed is not None:
            instance = name.removesuffix(f".{SERVICE_TYPE}")
            if instance.startswith(INSTANCE_PREFIX):
                self._on_removed(instance.removeprefix(INSTANCE_PREFIX))

    async def _resolve(self, zeroconf: Zeroconf, service_type: str, name: str) -> None:
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(zeroconf, LOOKUP_TIMEOUT_MS):
            return
        props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
        node_id = props.get("id")
        if not node_id or node_id == self.node_id:
            return
        port = int(info.port or 0)
        addresses = [PeerAddress(host, port, node_id) for host in info.parsed_addresses(IPVersion.V4Only)]
        if props.get("key") != self.cluster_digest:
            self._found_other_cluster(node_id, addresses)
            return
        for peer in addresses:
            self._on_found(peer)

    def _found_other_cluster(self, node_id: str, addresses: list[PeerAddress]) -> None:
        if node_id not in self._other_cluster_ids:
            self._other_cluster_ids.add(node_id)
            log.info("node %s: refusing peer %s found on mDNS: it has a different cluster key", self.node_id, node_id)
        if self._on_other_cluster is not None and addresses:
            self._on_other_cluster(addresses[0])

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zeroconf is not None:
            if self._info is not None:
                await self._zeroconf.async_unregister_service(self._info)
            await self._zeroconf.async_close()
