"""Static peers from `--peers host:port,...`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int
    node_id: str | None = None  # known from mDNS TXT records; unknown for static peers until the handshake

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_peers(spec: str | None, default_port: int = 52415) -> list[PeerAddress]:
    """'a:1,b,[::1]:3' -> addresses; a missing port means the default. Raises ValueError on a bad entry."""
    peers: list[PeerAddress] = []
    for raw in (spec or "").split(","):
        entry = raw.strip()
        if not entry:
            continue
        host, port = _split_host_port(entry, default_port)
        if not host or not 0 < port < 65536:
            raise ValueError(f"bad peer {entry!r}: expected host:port")
        peers.append(PeerAddress(host, port))
    return peers


def _split_host_port(entry: str, default_port: int) -> tuple[str, int]:
    if entry.startswith("["):  # [ipv6]:port
        host, _, rest = entry[1:].partition("]")
        return host, int(rest.lstrip(":") or default_port)
    if entry.count(":") == 1:
        host, port = entry.split(":")
        if not port.isdigit():
            raise ValueError(f"bad peer {entry!r}: port must be a number")
        return host, int(port)
    return entry, default_port
