"""Peers this node knows of but is not linked with, and why: shown in GET /v1/cluster and on the dashboard.

Discovery that fails without a word is what users of such clusters complain about most: a firewall, another
cluster key, another exo-like version, or an advertised address that does not reach the machine. Every failed
attempt is recorded here under the address tried. A warning is logged when an address's reason first appears or
changes (redials every few seconds repeat it at debug level only); a link to that address or node clears it, and
a problem that stops recurring is dropped after SHOWN_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

SHOWN_SECONDS = 30.0  # longer than the finder's redial interval, so a persistent problem stays listed


@dataclass
class LinkProblem:
    host: str
    port: int | None  # the port this node dialed; None for a peer that dialed in (its listening port is unknown)
    code: str  # unreachable, not_exo_like, handshake_failed, key_mismatch, version_mismatch, other_cluster
    reason: str
    node_id: str | None
    since: float  # monotonic: when this reason was first seen for the address
    last: float  # monotonic: the latest attempt that failed for it

    @property
    def address(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"

    def to_json(self, now: float) -> dict[str, Any]:
        return {"address": self.address, "node_id": self.node_id, "code": self.code, "reason": self.reason,
                "since_seconds": round(now - self.since, 1)}


class LinkProblems:
    def __init__(self, node_id: str):
        self.node_id = node_id
        self._by_address: dict[tuple[str, int | None], LinkProblem] = {}

    def note(self, host: str, port: int | None, code: str, reason: str, node_id: str | None = None) -> None:
        now = time.monotonic()
        known = self._by_address.get((host, port))
        if known is not None and known.reason == reason:
            known.last = now
            known.node_id = node_id or known.node_id
            log.debug("node %s: still not linked with %s: %s", self.node_id, known.address, reason)
            return
        problem = self._by_address[(host, port)] = LinkProblem(host, port, code, reason, node_id, now, now)
        log.warning("node %s: not linked with %s%s: %s", self.node_id, problem.address,
                    f" (node {node_id})" if node_id else "", reason)

    def clear(self, node_id: str, *addresses: tuple[str, int | None]) -> None:
        """A link to `node_id` now exists: whatever kept this node from it is gone, whether it was recorded
        under the node's id or under one of the (host, port) addresses it is known by."""
        for key, problem in list(self._by_address.items()):
            if key in addresses or problem.node_id == node_id:
                del self._by_address[key]

    def to_json(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        for key, problem in list(self._by_address.items()):
            if now - problem.last > SHOWN_SECONDS:
                del self._by_address[key]
        dialed_hosts = {host for host, port in self._by_address if port is not None}
        # A peer that dialed in and was refused is known by its host alone; when this node dialed that host too,
        # the entry with the port says the same thing.
        return [problem.to_json(now) for (host, port), problem in sorted(self._by_address.items(), key=_order)
                if port is not None or host not in dialed_hosts]


def _order(item: tuple[tuple[str, int | None], LinkProblem]) -> tuple[str, int]:
    (host, port), _ = item
    return host, port or 0


def dial_failure(exc: BaseException) -> tuple[str, str]:
    """Why a dial failed, in words a user can act on: (code, reason)."""
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return "not_exo_like", f"not an exo-like node (HTTP {exc.status} where its peer link should be)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        errno = exc.os_error.errno
        detail = os.strerror(errno) if errno else str(exc.os_error)  # "Connection refused", "No route to host"
        return "unreachable", f"cannot connect ({detail}): check that exo-like runs there and that its port is " \
                              "open in the firewall"
    if isinstance(exc, asyncio.TimeoutError):
        return "unreachable", "no answer in time: a firewall dropping the traffic, or the machine is down"
    return "handshake_failed", f"link set-up failed: {exc or type(exc).__name__}"
